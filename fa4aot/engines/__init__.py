"""Engine plugins: fa4aot's store under the FA4 calls vLLM and SGLang make.

- `fa4aot.engines.vllm`: vLLM 0.33 (`vllm.general_plugins` entry point `register`).
- `fa4aot.engines.sglang`: SGLang 0.5.23 (`sglang.srt.plugins` entry point `register`).

Each wraps the engine's own FA4 entry point, serves the calls fa4aot serves exactly and hands
every other call back to the engine's function unchanged (docs/integrations.md). Importing this
package imports no engine.
"""
