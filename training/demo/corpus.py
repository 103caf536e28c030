"""Chat-style training corpus built from the Python standard library's sources and docstrings.

The stdlib is the one sizeable, well-written text that every machine running this project already has, so
the demo target can be trained without downloading anything. Each module is parsed (never imported: importing
runs code and differs per platform) and turned into question/answer records about its functions, classes and
methods: show the source, explain it (docstring), write the docstring for code, implement it from its
docstring. Whole module sources are added as plain-text records so the model also sees module-level code.

Whole top-level packages are held out by a hash of their name. The hash does not depend on which other
modules exist, so the split stays the same across Python versions (whose stdlibs differ slightly), and a
held-out package contributes nothing to training: acceptance measured on its prompts is measured on text the
target has never seen.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import random
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
MANIFEST_FILE = "manifest.json"

# Directories that are tests, bundled third-party code, generated data tables, or big version-specific
# packages (distutils is gone in 3.12): they add noise or make the corpus drift between machines.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "lib-dynload", "__pycache__", "test", "tests", "idle_test",
    "idlelib", "lib2to3", "turtledemo", "pydoc_data", "encodings", "distutils", "ensurepip",
})
# _sysconfigdata* holds this machine's build paths, so it would make the corpus machine-specific.
SKIP_FILE_PREFIXES = ("_sysconfigdata", "test_")

SOURCE_PROMPTS = (
    "Show the source of {what} `{name}`.",
    "Print the implementation of `{name}` from the Python standard library.",
    "How is `{name}` implemented? Show the code.",
)
EXPLAIN_PROMPTS = (
    "Explain what `{name}` does.",
    "What does the {what} `{name}` do?",
    "Describe `{name}`.",
)
DOCSTRING_PROMPTS = (
    "Write the docstring for this {what}:\n\n{code}",
    "Document this Python {what} with a docstring:\n\n{code}",
)
IMPLEMENT_PROMPTS = (
    "In module `{module}`, implement `{short}{signature}`: {summary}",
    "Write the {what} `{short}{signature}` for the `{module}` module. {summary}",
)
MODULE_PROMPTS = (
    "What is the `{module}` module for?",
    "Explain the purpose of the Python module `{module}`.",
)


@dataclass(frozen=True)
class Definition:
    """One function, class or method, with what the record templates need."""

    module: str
    qualname: str  # dotted, module included: "json.JSONEncoder.encode"
    what: str  # "function", "class" or "method"
    signature: str  # "(obj, *, skipkeys=False)" or "(Base)"; empty for a class without bases
    source: str  # dedented, decorators included
    source_without_doc: str | None  # None when the docstring cannot be cut out cleanly
    doc: str | None


@dataclass(frozen=True)
class CorpusInfo:
    """Where the corpus was written and what it holds (also saved as the manifest)."""

    train_path: Path
    heldout_path: Path
    train_records: int
    heldout_records: int
    modules: int
    heldout_packages: list[str]


def default_stdlib_dir() -> Path:
    """The running interpreter's stdlib: present on every machine, unlike any downloadable data set."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(package: str, heldout_percent: float) -> bool:
    """A stable hash of the top-level package name: independent of seed, Python version and other modules."""
    bucket = int(hashlib.sha256(package.encode()).hexdigest()[:8], 16) % 10_000
    return bucket < heldout_percent * 100


def module_files(root: Path, packages: Sequence[str] | None = None) -> list[tuple[str, Path]]:
    """(dotted module name, path) for every stdlib source kept, sorted so the corpus order is fixed."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into site-packages and the other skipped trees.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith(SKIP_FILE_PREFIXES):
                continue
            path = Path(dirpath) / filename
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if packages is None or parts[0] in packages:
                found.append((".".join(parts), path))
    return sorted(found)


def _definition(module: str, prefix: str, what: str, node: ast.AST, lines: list[str]) -> Definition:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    source = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
    doc = ast.get_docstring(node)
    without_doc = None
    first = node.body[0]
    doc_line = lines[first.lineno - 1]
    # Cut the docstring only when it stands on lines of its own and is not the whole body.
    if doc and len(node.body) > 1 and first.col_offset == len(doc_line) - len(doc_line.lstrip()):
        kept = lines[start - 1:first.lineno - 1] + lines[first.end_lineno:node.end_lineno]
        without_doc = textwrap.dedent("\n".join(kept))
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
        signature = f"({bases})" if bases else ""
    else:
        signature = f"({ast.unparse(node.args)})"
        if node.returns is not None:
            signature += f" -> {ast.unparse(node.returns)}"
    return Definition(module, f"{prefix}.{node.name}", what, signature, source, without_doc, doc)


def module_definitions(module: str, text: str, tree: ast.Module) -> list[Definition]:
    """Top-level functions and classes, and the methods of those classes, in source order."""
    lines = text.splitlines()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    found: list[Definition] = []
    for node in tree.body:
        if isinstance(node, functions):
            found.append(_definition(module, module, "function", node, lines))
        elif isinstance(node, ast.ClassDef):
            found.append(_definition(module, module, "class", node, lines))
            for child in node.body:
                if isinstance(child, functions):
                    found.append(_definition(module, f"{module}.{node.name}", "method", child, lines))
    return found


def _chat(user: str, assistant: str, module: str, task: str) -> dict:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "module": module, "task": task}


def _code(source: str) -> str:
    return f"```python\n{source}\n```"


def definition_records(d: Definition, seed: int, max_chars: int) -> list[dict]:
    """The question/answer records for one definition; phrasing is seeded by name, not by corpus order."""
    rng = random.Random(f"{seed}:{d.qualname}")
    fields = {"name": d.qualname, "what": d.what}
    records: list[dict] = []
    fits = len(d.source) <= max_chars
    if fits:
        records.append(_chat(rng.choice(SOURCE_PROMPTS).format(**fields), _code(d.source), d.module, "source"))
    if not d.doc:
        return records
    explained = f"`{d.qualname}{d.signature}`\n\n{d.doc}"
    records.append(_chat(rng.choice(EXPLAIN_PROMPTS).format(**fields), explained, d.module, "explain"))
    if d.source_without_doc is not None and len(d.source_without_doc) <= max_chars:
        prompt = rng.choice(DOCSTRING_PROMPTS).format(code=_code(d.source_without_doc), **fields)
        records.append(_chat(prompt, d.doc, d.module, "docstring"))
    if fits and d.what != "class":
        short = d.qualname[len(d.module) + 1:]
        summary = d.doc.split("\n\n")[0]
        prompt = rng.choice(IMPLEMENT_PROMPTS).format(
            module=d.module, short=short, signature=d.signature, summary=summary, **fields)
        records.append(_chat(prompt, _code(d.source), d.module, "implement"))
    return records


def module_records(module: str, path: Path, seed: int, max_chars: int, with_text: bool) -> list[dict]:
    """All records for one source file; a file this interpreter cannot parse yields none."""
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            text = f.read()
        tree = ast.parse(text, filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError, ValueError):
        return []
    records: list[dict] = []
    doc = ast.get_docstring(tree)
    if doc:
        prompt = random.Random(f"{seed}:{module}").choice(MODULE_PROMPTS).format(module=module)
        records.append(_chat(prompt, doc, module, "module"))
    for definition in module_definitions(module, text, tree):
        records.extend(definition_records(definition, seed, max_chars))
    if with_text and text.strip():
        records.append({"text": text, "module": module, "task": "text"})
    return records


def _dedupe(records: Iterable[dict]) -> list[dict]:
    """Drop repeated records (copy-pasted helpers exist in the stdlib), keeping the first occurrence."""
    seen: set[str] = set()
    kept = []
    for record in records:
        key = json.dumps(record.get("messages") or record["text"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept


def _write_jsonl(path: Path, records: Iterable[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a corpus file, one JSON object per line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def build_corpus(out_dir: str | os.PathLike, *, stdlib: str | os.PathLike | None = None,
                 packages: Sequence[str] | None = None, heldout_percent: float = 10.0, seed: int = 0,
                 max_source_chars: int = 6000, with_module_text: bool = True,
                 progress: bool = True) -> CorpusInfo:
    """Write train.jsonl (shuffled, seeded), heldout.jsonl (chat records only) and manifest.json.

    `packages` restricts the corpus to some top-level packages (tests use it to stay small). A held-out
    record whose prompt or answer also occurs in training (identical code or docstrings in two packages,
    e.g. `decimal` and `_pydecimal`) is dropped, so nothing measured on held-out prompts was memorized.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(stdlib) if stdlib is not None else default_stdlib_dir()
    files = module_files(root, packages)
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} (an install shipping only .pyc files?)")
    train: list[dict] = []
    heldout: list[dict] = []
    heldout_packages: set[str] = set()
    for module, path in tqdm(files, desc="corpus", unit="file", disable=not progress):
        package = module.split(".")[0]
        held = is_heldout(package, heldout_percent)
        records = module_records(module, path, seed, max_source_chars, with_text=with_module_text and not held)
        if held:
            heldout_packages.add(package)
            heldout.extend(records)
        else:
            train.extend(records)
    train = _dedupe(train)
    seen = {m["content"] for r in train if "messages" in r for m in r["messages"]}
    heldout = [r for r in _dedupe(heldout) if not any(m["content"] in seen for m in r["messages"])]
    random.Random(seed).shuffle(train)
    _write_jsonl(out / TRAIN_FILE, train)
    _write_jsonl(out / HELDOUT_FILE, heldout)
    info = CorpusInfo(out / TRAIN_FILE, out / HELDOUT_FILE, len(train), len(heldout), len(files),
                      sorted(heldout_packages))
    # File names, not paths: the manifest must not depend on where the corpus was built.
    manifest = {**asdict(info), "train_path": TRAIN_FILE, "heldout_path": HELDOUT_FILE, "seed": seed,
                "heldout_percent": heldout_percent,
                "max_source_chars": max_source_chars, "with_module_text": with_module_text,
                "python_version": platform.python_version(), "packages": list(packages) if packages else None}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return info
