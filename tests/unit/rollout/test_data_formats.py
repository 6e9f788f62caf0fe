"""Data sets as users bring them: JSONL, Parquet and `datasets.save_to_disk` directories, read
through the config's column mapping (rollout/data_files.py, rollout/dataset.py).

The same rows written in each format must give the same Prompts; a bad row is reported with its
file and row and skipped, whatever the format; a mapped field is read from its column only."""
from __future__ import annotations

import datetime
import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tandem.rollout.dataset import DatasetError, load_file, load_prompts  # noqa: E402

MAPPING = {"prompt": "question", "answer": "final_answer", "id": "uid"}
ROWS = [
    {"question": "1+1?", "final_answer": 2, "uid": 10, "source": "a"},
    {"question": "", "final_answer": 3, "uid": 11, "source": "b"},        # no text: skipped
    {"question": "2+2?", "final_answer": 4, "uid": 12, "source": "c"},
]


def _write(fmt: str, tmp_path, rows: list[dict]):
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets  # imported where used: it takes about a second

        path = tmp_path / "d"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _where(fmt: str, path, index: int) -> str:
    """How a bad row is named: file:line (from 1) for JSONL, file: row N (from 0) otherwise."""
    return f"{path}:{index + 1}" if fmt == "jsonl" else f"{path}: row {index}"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_every_format_reads_the_same_prompts_through_the_mapping(fmt, tmp_path, caplog):
    path = _write(fmt, tmp_path, ROWS)
    prompts = load_file(path, "math", MAPPING)
    assert [(p.id, p.text, p.reference) for p in prompts] == [("10", "1+1?", {"answer": "2"}),
                                                              ("12", "2+2?", {"answer": "4"})]
    # The row's other columns go along (for a reward function), not the ones read into the prompt.
    assert [p.row for p in prompts] == [{"uid": 10, "source": "a"}, {"uid": 12, "source": "c"}]
    assert f"{_where(fmt, path, 1)}: no problem text in 'question' (the column mapped to prompt)" in caplog.text
    assert f"{path}: 2 usable rows, 1 skipped" in caplog.text


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_without_a_mapping_the_usual_field_names_still_work(fmt, tmp_path):
    rows = [{"problem": "1+1?", "answer": "2"}, {"prompt": "3+3?", "answer": "6", "id": "x"}]
    if fmt != "jsonl":   # one schema for every row of a columnar file
        rows = [{"problem": "1+1?", "answer": "2", "id": None}, {"problem": "3+3?", "answer": "6", "id": "x"}]
    prompts = load_file(_write(fmt, tmp_path, rows), "math")
    assert [(p.text, p.reference["answer"]) for p in prompts] == [("1+1?", "2"), ("3+3?", "6")]
    assert prompts[1].id == "x"


def test_a_mapped_field_is_read_from_its_column_only(tmp_path):
    """A row with both `problem` and the mapped `question`: the mapping wins, and a row lacking
    the mapped column is bad even though a default column is there."""
    rows = [{"problem": "wrong text", "question": "right text", "answer": "1"},
            {"problem": "only the default", "question": None, "answer": "2"}]
    path = _write("parquet", tmp_path, rows)
    assert [p.text for p in load_file(path, "math")] == ["wrong text", "only the default"]
    assert [p.text for p in load_file(path, "math", {"prompt": "question"})] == ["right text"]


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_code_rows_from_columnar_formats(fmt, tmp_path):
    """Tests as a nested column (structs and lists) or as a JSON string, as the Hub stores them."""
    cases = {"inputs": ["1\n", "2\n"], "outputs": ["2\n", "4\n"]}
    rows = [{"statement": "double it", "io": json.dumps(cases), "cases": [{"input": "1\n", "output": "2\n"}]},
            {"statement": "no tests", "io": "not json", "cases": []}]
    path = _write(fmt, tmp_path, rows)
    got = load_file(path, "code", {"prompt": "statement", "tests": "io"})
    assert [(p.text, p.reference["tests"]) for p in got] == [("double it", cases)]
    listed = load_file(path, "code", {"prompt": "statement", "tests": "cases"})
    assert [p.reference["tests"] for p in listed] == [{"inputs": ["1\n"], "outputs": ["2\n"]}]


def test_values_a_columnar_format_gives_are_made_json_like_in_the_row(tmp_path):
    rows = [{"problem": "1+1?", "answer": "2", "day": datetime.date(2024, 5, 1), "tags": ["x", "y"]}]
    (prompt,) = load_file(_write("parquet", tmp_path, rows), "math")
    assert prompt.row == {"day": "2024-05-01", "tags": ["x", "y"]}


def test_a_datasetdict_directory_names_its_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "1+1?", "answer": "2"}]),
                               "test": datasets.Dataset.from_list([{"problem": "2+2?", "answer": "4"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd: a DatasetDict with splits (train, test|test, train); "
                                           r"name the split's directory \(e\.g\. .*dd/(train|test)\)"):
        load_file(tmp_path / "dd", "math")
    assert [p.text for p in load_file(tmp_path / "dd" / "test", "math")] == ["2+2?"]


def test_what_is_no_data_set_is_refused_with_the_reason(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="not one written by save_to_disk"):
        load_file(tmp_path / "plain", "math")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match=r"d\.csv: not a data set format Tandem reads"):
        load_file(tmp_path / "d.csv", "math")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match=r"broken\.parquet: cannot read it as Parquet"):
        load_file(tmp_path / "broken.parquet", "math")
    with pytest.raises(DatasetError, match="no usable rows"):
        load_file(_write("parquet", tmp_path, [{"x": 1}]), "math")


def test_load_prompts_asks_every_problem_with_the_system_prompt_and_template(tmp_path):
    path = _write("parquet", tmp_path, ROWS)
    prompts = load_prompts(str(path), "math", 0, 0, MAPPING, "Be brief.", "Q: {prompt}\nA:")
    assert prompts[0].text == "1+1?"      # graded and deduplicated on the problem itself
    assert prompts[0].messages() == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Q: 1+1?\nA:"}]
    synthetic = load_prompts("synthetic:math", "math", 3, 0, {}, "", "Solve: {prompt}")
    assert [p.messages() for p in synthetic] == [[{"role": "user", "content": f"Solve: {p.text}"}]
                                                  for p in synthetic]
