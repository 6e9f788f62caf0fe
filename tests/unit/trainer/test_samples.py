"""Sample completions (trainer/samples.py): every `every` steps a `samples` record in
metrics.jsonl holds a few of the step's trained samples, decoded by the model's own tokenizer,
with reward and the versions that wrote them; `every: 0` writes none."""
from __future__ import annotations

from transformers import AutoTokenizer

from tandem.services.protocol import MetricsWriter, read_metrics
from tandem.trainer.buffer import Group
from tandem.trainer.samples import SampleLog, SamplesConfig


def records(exp):
    return [r for r in read_metrics(exp, "trainer") if r.get("event") == "samples"]


def make_groups(traj, tok, n_groups: int):
    out = []
    for i in range(n_groups):
        prompt = tok.encode(f"What is {i}+{i}?", add_special_tokens=False)
        samples = [traj(f"g{i}", j, 2, admit_version=3, reward=5.0 if j else -5.0, prompt=prompt,
                        output=tok.encode(f"answer {j} of {i}", add_special_tokens=False),
                        versions=[3] * 6 + [4] * 4) for j in range(2)]
        out.append(Group(f"g{i}", 3, i, samples))
    return out


def test_every_k_steps_a_few_samples_are_recorded_as_text(exp, traj, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    log = SampleLog(SamplesConfig(every=2, n=2), str(tiny_model_dir), seed=0, metrics=MetricsWriter(exp, "trainer"))
    groups = make_groups(traj, tok, 5)
    for step in (1, 2, 3, 4):
        log.log(step, groups)
    recs = records(exp)
    assert [r["step"] for r in recs] == [2, 4] and all(len(r["samples"]) == 2 for r in recs)
    for row in (row for r in recs for row in r["samples"]):
        i, j = int(row["group_id"][1:]), row["sample_idx"]
        assert row["prompt"] == f"What is {i}+{i}?" and row["response"] == f"answer {j} of {i}"
        assert row["reward"] == (5.0 if j else -5.0) and (row["version_min"], row["version_max"]) == (3, 4)
        assert row["admit_version"] == 3 and row["finish_reason"] == "stop"
    assert len({row["group_id"] for row in recs[0]["samples"]}) == 2    # one sample from each of two groups


def test_off_writes_nothing_and_long_texts_are_cut(exp, traj, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = make_groups(traj, tok, 1)
    SampleLog(SamplesConfig(every=0), str(tiny_model_dir), 0, MetricsWriter(exp, "trainer")).log(10, groups)
    assert records(exp) == []
    SampleLog(SamplesConfig(every=1, n=1, max_chars=4), str(tiny_model_dir), 0, MetricsWriter(exp, "trainer")).log(1, groups)
    row = records(exp)[0]["samples"][0]
    assert row["prompt"] == "What [... 8 more characters]" and row["prompt_chars"] == 12
    assert SamplesConfig(every=-1, n=0).problems() == [("every", "must be >= 0, got -1"), ("n", "must be >= 1, got 0")]
