"""The docs stay true to the code (CPU, fast): the CLI reference is generated and current, every
command, option, error class and environment variable is documented, commands quoted in the
docs exist with the options they show, and relative links (and their anchors) resolve."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
from pathlib import Path

import click
import pytest

import fa4aot.errors
from fa4aot.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PKG = ROOT / "fa4aot"
CLI_MD = DOCS / "cli.md"
TROUBLE_MD = DOCS / "troubleshooting.md"
ENV_RE = re.compile(r"FA4AOT_[A-Z_]+")


def _load_gen():
    spec = importlib.util.spec_from_file_location("fa4aot_docs_gen_cli", DOCS / "gen_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    return _load_gen()


@pytest.fixture(scope="module")
def rendered(gen) -> str:
    return gen.render()


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _strip_fences(text: str) -> tuple[list[str], list[str]]:
    """-> (lines outside fenced code blocks, lines inside them)."""
    prose, code, fence = [], [], None
    for line in text.splitlines():
        m = re.match(r"\s*(```+|~~~+)", line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = m.group(1) if fence is None else None
            continue
        (code if fence else prose).append(line)
    return prose, code


_SPAN = re.compile(r"(`+)(.+?)\1")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(path: Path) -> list[str]:
    prose, _ = _strip_fences(path.read_text())
    return [m.group(2) for line in prose if (m := re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line))]


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in _headings(path):
        s = _slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(main, info_name="fa4aot")
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def _option_names(cmd: click.Command) -> set[str]:
    ctx = click.Context(cmd)
    names = set()
    for p in cmd.get_params(ctx):
        names.update(getattr(p, "opts", ()))
        names.update(getattr(p, "secondary_opts", ()))
    return names


# -- the generated CLI reference -------------------------------------------------------------


def test_cli_reference_is_up_to_date(gen, rendered, capsys):
    rc = gen.main(["--check"])
    assert rc == 0, "docs/cli.md is stale; run: python docs/gen_cli.py\n" + capsys.readouterr().err
    assert CLI_MD.read_text() == rendered


def test_the_check_fails_on_a_stale_or_missing_page_and_passes_once_regenerated(
    gen, rendered, tmp_path
):
    page = tmp_path / "cli.md"
    assert gen.main(["--check", "--output", str(page)]) == 1  # missing
    lines = rendered.splitlines(keepends=True)
    page.write_text("".join(lines[:-3] + lines[-2:]))  # one line dropped
    assert gen.main(["--check", "--output", str(page)]) == 1
    assert gen.main(["--output", str(page)]) == 0  # regenerate
    assert page.read_text() == rendered
    assert gen.main(["--check", "--output", str(page)]) == 0


def test_rendering_is_deterministic_and_machine_defaults_are_described_not_printed(gen, rendered):
    assert gen.render() == rendered
    machine = gen._machine_defaults()
    for (path, _, opts), description in machine.items():
        section = rendered.split(f"\n## {' '.join(path)}\n", 1)[1].split("\n## ", 1)[0]
        row = next(r for r in section.splitlines() if r.startswith(f"| `{opts[0]}`"))
        assert f"| {description} |" in row, row


def test_every_command_and_option_appears_in_cli_md(gen):
    text = CLI_MD.read_text()
    walked = list(gen._walk(main))
    assert len(walked) > 5
    for path, cmd, ctx in walked:
        heading = f"\n## {' '.join(path)}\n"
        assert heading in text, f"{' '.join(path)} has no section in docs/cli.md"
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        if cmd.help:
            first = gen._help_text(cmd.help)[0]
            assert first in section
        for p in cmd.get_params(ctx):
            if getattr(p, "hidden", False) or "--help" in getattr(p, "opts", ()):
                continue
            shown = p.human_readable_name if isinstance(p, click.Argument) else p.opts[0]
            assert f"`{shown}`" in section, f"{' '.join(path)}: {shown} missing from docs/cli.md"


# -- errors and environment variables --------------------------------------------------------


def _exception_classes() -> set[str]:
    """Exception classes of errors.py, plus any exception class defined elsewhere in fa4aot."""
    found = {
        name
        for name, obj in vars(fa4aot.errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == fa4aot.errors.__name__
    }
    known = found | {
        n for n, o in vars(builtins).items() if isinstance(o, type) and issubclass(o, BaseException)
    }
    classes = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                classes.append((node.name, bases))
    changed = True
    while changed:
        changed = False
        for name, bases in classes:
            if name not in known and bases & known:
                known.add(name)
                found.add(name)
                changed = True
    return found


def test_every_error_class_has_a_troubleshooting_section():
    classes = _exception_classes()
    assert {"Fa4aotError", "ArtifactMissing", "CorruptArtifact", "LockTimeout"} <= classes
    text = TROUBLE_MD.read_text()
    prose, _ = _strip_fences(text)
    for name in sorted(classes):
        idx = next(
            (
                i
                for i, line in enumerate(prose)
                if re.match(r"#{2,6}\s", line) and re.search(rf"(?<!\w){name}(?!\w)", line)
            ),
            None,
        )
        assert idx is not None, f"docs/troubleshooting.md has no section for {name}"
        body = []
        for line in prose[idx + 1 :]:
            if re.match(r"#{1,6}\s", line):
                break
            body.append(line)
        assert sum(bool(b.strip()) for b in body) >= 2, f"the {name} section is empty"


def test_every_raised_error_class_is_a_documented_one():
    """Every `raise X(...)` of an fa4aot exception class names a class with a section."""
    classes = _exception_classes()
    raised = set()
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            # `raise X(...)`, and `return X(...)` of helpers such as `_fail` that build one
            value = node.exc if isinstance(node, ast.Raise) else getattr(node, "value", None)
            if isinstance(node, (ast.Raise, ast.Return)) and isinstance(value, ast.Call):
                fn = value.func
                name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
                if name in classes:
                    raised.add(name)
    assert {"ContractViolation", "SpecError", "UnsafeArchive", "CorruptArtifact"} <= raised
    headings = "\n".join(_headings(TROUBLE_MD))
    for name in raised:
        assert re.search(rf"(?<!\w){name}(?!\w)", headings), name


def _env_vars() -> set[str]:
    """Every FA4AOT_* variable: the settings (fa4aot/settings.py, where they are read) and any
    name spelled out in the package's code or docstrings."""
    from fa4aot.settings import Settings

    files = sorted(PKG.rglob("*.py"))
    spelled = {m.rstrip("_") for f in files for m in ENV_RE.findall(f.read_text())}
    return spelled | {s.env for s in Settings.all()}


def test_every_variable_named_in_the_code_is_a_setting():
    from fa4aot.settings import Settings

    known = {s.env for s in Settings.all()}
    assert {"FA4AOT_SPLIT_KV", "FA4AOT_PADDING", "FA4AOT_CACHE_DIR"} <= known
    assert _env_vars() == known, sorted(_env_vars() - known)


def test_every_environment_variable_is_documented():
    names = _env_vars()
    assert {"FA4AOT_CACHE_DIR", "FA4AOT_ON_MISS", "FA4AOT_RUNTIME_LIB"} <= names
    text = "\n".join(p.read_text() for p in _doc_files())
    missing = [n for n in sorted(names) if not re.search(rf"(?<![A-Z0-9_]){n}(?![A-Z0-9_])", text)]
    assert not missing, f"environment variables no doc mentions: {missing}"


def test_the_environment_variable_table_lists_every_variable():
    text = TROUBLE_MD.read_text().split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1) for m in re.finditer(r"^\| `(FA4AOT_[A-Z_]+)` \|", text, re.MULTILINE)}
    assert rows == _env_vars(), (sorted(_env_vars() - rows), sorted(rows - _env_vars()))


# -- links and quoted commands ---------------------------------------------------------------

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_relative_links_and_anchors_resolve():
    checked = 0
    for doc in _doc_files():
        prose, _ = _strip_fences(doc.read_text())
        for line in prose:
            for target in _LINK.findall(_SPAN.sub("", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                assert dest.exists(), f"{doc.name}: broken link {target}"
                if anchor and dest.suffix == ".md":
                    assert anchor in _anchors(dest), (
                        f"{doc.name}: no anchor #{anchor} in {dest.name}"
                    )
                checked += 1
    assert checked > 20


def test_readme_links_the_reference_pages():
    readme = (ROOT / "README.md").read_text()
    for page in ("cache-format.md", "cli.md", "integrations.md", "troubleshooting.md"):
        assert f"(docs/{page})" in readme, f"README.md does not link docs/{page}"


_INVOCATION = re.compile(r"(?:^|(?<=[\s;&|(/]))fa4aot[ \t]+([a-z][\w-]*)")
# what may precede a command name: a shell separator, `$ `, VAR=value assignments, a path
_COMMAND_POSITION = re.compile(
    r"(?:.*(?:&&|;|\||\$\())?\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?"
)


def _code_segments(doc: Path) -> list[str]:
    prose, code = _strip_fences(doc.read_text())
    return code + [m.group(2) for line in prose for m in _SPAN.finditer(line)]


def test_commands_quoted_in_the_docs_exist_with_the_options_shown():
    """`fa4aot <command> --option` in code (spans and blocks) of the hand-written docs: the
    command and each option exist. docs/cli.md is generated from the CLI and skipped."""
    commands = _commands()
    seen = 0
    for doc in _doc_files():
        if doc == CLI_MD:
            continue
        for seg in _code_segments(doc):
            matches = list(_INVOCATION.finditer(seg))
            for i, m in enumerate(matches):
                cmd = m.group(1)
                where = f"{doc.name}: `{seg.strip()}`"
                if cmd not in commands:
                    # prose in a code comment ("... which fa4aot refuses") is not an invocation
                    at_command = _COMMAND_POSITION.fullmatch(seg[: m.start()]) is not None
                    assert not at_command, f"{where}: no command fa4aot {cmd}"
                    continue
                end = matches[i + 1].start() if i + 1 < len(matches) else len(seg)
                rest = re.split(r"&&|;|\s\|\s|\s#", seg[m.end() : end])[0]
                opts = _option_names(commands[cmd]) | {"--help"}
                for token in rest.split():
                    for piece in re.split(r"\\?\|", token.strip("[](),.`'\"")):
                        if re.match(r"--?[A-Za-z]", piece):
                            name = piece.split("=")[0].rstrip(".,;:)]")
                            assert name in opts, f"{where}: fa4aot {cmd} has no option {name}"
                seen += 1
    assert seen > 20


# -- the README's set-up, the benchmarks and the GPU outputs the docs cite ----------------------


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_readme_setup_commands_are_what_ci_runs():
    """.ci/run runs the README's two set-up commands, byte for byte, and nothing else."""
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("\n## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip() for b in _fenced_blocks(setup)]
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), blocks
    assert blocks[0].endswith("fa4aot build --cache cache") and "pytest" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == blocks


def test_benchmarks_the_docs_name_exist():
    named = set()
    for doc in _doc_files():
        named.update(re.findall(r"benchmarks/([\w-]+\.(?:py|sh|c))", doc.read_text()))
    assert {"decode_split.py", "startup.py", "host_overhead.py"} <= named
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / n).exists())
    assert not missing, f"the docs name benchmarks that do not exist: {missing}"


_GPU_LOG = re.compile(r"(?<![\w.-])(20\d\d-\d\d-\d\d-[\w.-]*?\.(?:txt|json))(?![\w-])")


def test_every_gpu_output_kept_is_cited_and_every_cited_one_is_kept():
    """docs/gpu holds exactly the outputs the docs cite: each file is named in README.md or
    docs/*.md and indexed in docs/gpu-tests.md, and each output a doc names exists there."""
    gpu = DOCS / "gpu"
    kept = {p.name for p in gpu.iterdir() if p.is_file()}
    assert kept, "docs/gpu is empty"
    texts = {doc: doc.read_text() for doc in _doc_files()}
    everything = "\n".join(texts.values())
    uncited = sorted(n for n in kept if n not in everything)
    assert not uncited, f"docs/gpu files no doc cites (cite them or delete them): {uncited}"
    cited = {(doc.name, m) for doc, text in texts.items() for m in _GPU_LOG.findall(text)}
    assert len(cited) > 20
    missing = sorted((d, n) for d, n in cited if n not in kept)
    assert not missing, f"docs cite GPU outputs docs/gpu does not hold: {missing}"
    index = (DOCS / "gpu-tests.md").read_text()
    unindexed = sorted(n for n in kept if n not in index)
    assert not unindexed, f"docs/gpu-tests.md does not index {unindexed}"
