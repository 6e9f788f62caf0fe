"""LiveCodeBench rows (`livecodebench/code_generation_lite`, saved as JSONL) as Tandem code prompts.

A row holds `question_content`, `starter_code`, `public_test_cases` and `private_test_cases`
(JSON lists of `{input, output, testtype}`; the private ones in the lite release are compressed:
base64 of zlib of a pickled JSON string) and `metadata` (`func_name` for LeetCode problems).
Functional tests give each argument as one JSON line of `input` and the return value as JSON;
they are decoded here, once, so the sandbox receives plain values. The tests carry
`convention: livecodebench`, so the grader applies that benchmark's implicit imports and
comparison rules (docs/reward.md, "Conventions").

The pickle is read by an unpickler that refuses every class and function: the payload is a
string, and a data file must never run code on the grader.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import zlib

MAX_DECOMPRESSED = 1 << 30      # bytes of one row's private tests (a zlib bomb stops here)


class LiveCodeBenchRowError(ValueError):
    pass


class _StringsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: LiveCodeBench tests are a pickled string")


def is_livecodebench_row(row: dict) -> bool:
    return "question_content" in row and "public_test_cases" in row


def _cases(raw, which: str) -> list[dict]:
    if raw in (None, ""):
        return []
    if isinstance(raw, list):
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        pass
    try:
        inflater = zlib.decompressobj()
        data = inflater.decompress(base64.b64decode(raw, validate=True), MAX_DECOMPRESSED)
        if inflater.unconsumed_tail:
            raise LiveCodeBenchRowError(f"{which} decompress to over {MAX_DECOMPRESSED >> 20} MB")
        text = _StringsOnly(io.BytesIO(data)).load()
        return json.loads(text)
    except LiveCodeBenchRowError:
        raise
    except (binascii.Error, zlib.error, pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
        raise LiveCodeBenchRowError(f"{which} are neither JSON nor LiveCodeBench's compressed form "
                                    f"({type(e).__name__}: {e})") from None


def public_cases(row: dict) -> list:
    """The row's public test cases (its problem statement shows them); they come first in the
    tests of `livecodebench_prompt`."""
    return _cases(row.get("public_test_cases"), "public_test_cases")


def livecodebench_prompt(row: dict) -> tuple[str, str, dict]:
    """(id, problem text, tests) of one row; LiveCodeBenchRowError says what is wrong."""
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise LiveCodeBenchRowError("metadata is not JSON") from None
    cases = public_cases(row) + \
        _cases(row.get("private_test_cases"), "private_test_cases")
    if not all(isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
               for c in cases):
        raise LiveCodeBenchRowError("every test case needs text 'input' and 'output'")
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    tests: dict = {"convention": "livecodebench"}
    if fn_name:
        try:
            tests["inputs"] = [[json.loads(line) for line in c["input"].split("\n")] for c in cases]
            tests["outputs"] = [json.loads(c["output"]) for c in cases]
        except json.JSONDecodeError as e:
            raise LiveCodeBenchRowError(f"a functional test is not JSON lines ({e.msg})") from None
        tests["fn_name"] = fn_name
    else:
        tests["inputs"] = [c["input"] for c in cases]
        tests["outputs"] = [c["output"] for c in cases]
    text = row["question_content"]
    if row.get("starter_code"):
        text += f"\n\nUse this starter code:\n```python\n{row['starter_code']}\n```"
    return str(row.get("question_id", row.get("id", ""))), text, tests
