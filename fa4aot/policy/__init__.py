"""fa4aot's own choices: which stored variant serves a call (`select`), split-KV plans
(`split`), the KV block sizes to offer an engine (`blocks`)."""
