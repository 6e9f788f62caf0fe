"""`tandem config check` on a user's own data and prompts (launcher/preflight.py,
rollout/data_check.py): every format is opened and read as the workers will, a mapped column
that is not there is blamed on the mapping's line naming the column and the file, a template
that cannot ask the problem is refused naming its key, and a data set that passes is said with
its row count."""
from __future__ import annotations

import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from model_dirs import checked_model_dir  # noqa: E402

from tandem.launcher.cli import main  # noqa: E402
from tandem.launcher.config import ConfigError, load_config_traced  # noqa: E402
from tandem.launcher.preflight import check_before_launch  # noqa: E402

EXP = """\
experiment:
  name: byo
  model: {model}
  exp_dir: {exp_dir}
launcher:
  backend: slurm
  nodes: 1
  gpus_per_node: 4
gen:
  backend: sglang
rollout:
  dataset: {dataset}
  columns:
    prompt: {prompt_col}
    answer: final_answer
  prompt_template: {template}
"""
ROWS = [{"question": f"{i}+{i}?", "final_answer": str(2 * i), "level": i % 3} for i in range(5)]


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def _write(tmp_path, dataset, prompt_col="question", template='"Q: {prompt}"'):
    checked_model_dir(tmp_path / "model")
    path = tmp_path / "exp.yaml"
    path.write_text(EXP.format(model=tmp_path / "model", exp_dir=tmp_path / "run", dataset=dataset,
                               prompt_col=prompt_col, template=template))
    return path


def _check(path, *overrides) -> list[str]:
    cfg, prov = load_config_traced(path, list(overrides))
    return check_before_launch(cfg, prov)


def _line(path, needle):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_a_parquet_file_with_its_mapping_passes_and_says_its_rows(tmp_path, parquet, capsys):
    path = _write(tmp_path, parquet)
    assert _check(path) == [f"rollout.dataset: {parquet}: 5 rows (Parquet; prompt <- question, answer <- final_answer)"]
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: OK") and out[1] == f"  rollout.dataset: {parquet}: 5 rows " \
                                                          f"(Parquet; prompt <- question, answer <- final_answer)"


def test_rows_the_workers_will_skip_are_counted_with_the_first_reason(tmp_path):
    """A data set that loses rows to a broken export or a missing field passes (the workers skip
    such rows) but says so: before, three rows of which two were unusable read '3 rows'."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([json.dumps(ROWS[0]), json.dumps({"question": "1+1?"}), "not json",
                               json.dumps(ROWS[1])]) + "\n")
    assert _check(_write(tmp_path, data)) == [
        f"rollout.dataset: {data}: 4 rows (JSONL; prompt <- question, answer <- final_answer); 2 of the first 4 "
        f"rows cannot be used and will be skipped, the first: {data}:2: math row has no 'final_answer' (the column "
        f"mapped to answer)"]


def test_a_save_to_disk_directory_passes_and_says_its_rows(tmp_path):
    import datasets  # imported where used: it takes about a second

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    notes = _check(_write(tmp_path, tmp_path / "ds"))
    assert notes == [f"rollout.dataset: {tmp_path / 'ds'}: 5 rows (datasets save_to_disk; "
                     f"prompt <- question, answer <- final_answer)"]


def test_a_missing_data_set_is_refused_before_anything_starts(tmp_path):
    path = _write(tmp_path, tmp_path / "nope.parquet")
    with pytest.raises(ConfigError) as e:
        _check(path)
    assert str(e.value) == f"{path}:{_line(path, 'dataset:')}: rollout.dataset: {tmp_path / 'nope.parquet'}: " \
                           f"no such file or directory"


def test_a_mapped_column_that_is_not_there_names_the_column_the_file_and_the_key(tmp_path, parquet):
    path = _write(tmp_path, parquet, prompt_col="problem_text")
    with pytest.raises(ConfigError) as e:
        _check(path)
    assert str(e.value) == (f"{path}:{_line(path, 'prompt: problem_text')}: rollout.columns.prompt: column "
                            f"'problem_text' is not in {parquet} (its columns: final_answer, level, question)")
    # JSONL has no schema: the columns of its first rows stand for it.
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ConfigError, match=r"rollout\.columns\.prompt: column 'problem_text' is not in the first 5 "
                                          r"rows of .*train\.jsonl \(its columns: final_answer, level, question\)"):
        _check(path, f"rollout.dataset={jsonl}")


def test_an_unmapped_field_with_none_of_its_usual_columns_says_how_to_map_it(tmp_path, parquet):
    path = _write(tmp_path, parquet)
    path.write_text(path.read_text().replace("    answer: final_answer\n", ""))
    with pytest.raises(ConfigError, match=r"rollout\.dataset: .*train\.parquet has no answer column: none of "
                                          r"'answer' or 'solution_answer' \(its columns: final_answer, level, "
                                          r"question\); map one with rollout\.columns\.answer$"):
        _check(path)


def test_the_eval_data_set_is_checked_with_its_own_mapping(tmp_path, parquet):
    other = tmp_path / "eval.parquet"
    pq.write_table(pa.Table.from_pylist([{"Problem": "1+2?", "Answer": "3"}]), other)
    path = _write(tmp_path, parquet)
    with pytest.raises(ConfigError) as e:
        _check(path, f"rollout.eval_dataset={other}")      # no eval_columns: the training mapping is used
    assert f"{path}:{_line(path, 'prompt: question')}: rollout.columns.prompt: column 'question' is not in " \
           f"{other} (its columns: Answer, Problem); rollout.eval_columns maps this data set's own" in str(e.value)
    notes = _check(path, f"rollout.eval_dataset={other}", "rollout.eval_columns={prompt: Problem, answer: Answer}")
    assert notes[1] == f"rollout.eval_dataset: {other}: 1 row (Parquet; prompt <- Problem, answer <- Answer)"
    with pytest.raises(ConfigError, match=r"command line: rollout\.eval_columns\.answer: column 'Solution'"):
        _check(path, f"rollout.eval_dataset={other}", "rollout.eval_columns={prompt: Problem, answer: Solution}")


@pytest.mark.parametrize("template, why", [
    ('"Solve the problem."', "must contain {prompt}, where the problem text goes"),
    ('"{prompt} in \\\\boxed{}"', "unknown field {}: only {prompt} is filled in"),
    ('"{prompt} {answer}"', "unknown field {answer}"),
])
def test_a_template_that_cannot_ask_the_problem_is_refused_naming_its_key(tmp_path, parquet, template, why):
    path = _write(tmp_path, parquet, template=template)
    with pytest.raises(ConfigError) as e:
        _check(path)
    assert str(e.value).startswith(f"{path}:{_line(path, 'prompt_template:')}: rollout.prompt_template: {why}")


def test_a_mapping_of_something_that_is_no_field_is_refused(tmp_path, parquet):
    with pytest.raises(ConfigError, match=r"command line: rollout\.columns\.question: not a field of a row; map one "
                                          r"of prompt, answer, tests, visible_tests, id"):
        _check(_write(tmp_path, parquet), "rollout.columns.question=problem")


def test_a_problem_longer_than_any_context_is_a_row_the_workers_skip(tmp_path):
    """Two 20 MB rows once passed the check, and a worker tokenizing them on its event loop let
    its leases expire and grew to 4.3 GiB: such a row is now one the workers skip, and said so."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([json.dumps(ROWS[0]), json.dumps({**ROWS[1], "question": "x" * 2_000_001})]) + "\n")
    (note,) = _check(_write(tmp_path, data))
    assert note.endswith(f"1 of the first 2 rows cannot be used and will be skipped, the first: {data}:2: a "
                         f"problem of 2,000,001 characters in 'question' (the column mapped to prompt) "
                         f"(at most 1,000,000: longer than any context)"), note
