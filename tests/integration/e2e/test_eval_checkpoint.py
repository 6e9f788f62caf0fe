"""`tandem eval --exp DIR --checkpoint vN`: a trainer checkpoint scored end to end.

The experiment is made cheaply: its resolved config (tiny base model, synthetic math, short
answers) and two checkpoints written with the trainer's own `checkpoint.save`, in the torch
backend's layout (`{"backend": {"model": state_dict, ...}}`). v2 holds *other* weights than the
base model (the tiny model of another seed), so an answer from the base model, or from the
wrong checkpoint, is caught: the answers must be the checkpoint's greedy answers, computed here
with a plain transformers `generate` over the run's chat template. Then the errors a user meets:
a version with no checkpoint (the message lists those that exist), a sharded Megatron
checkpoint, a directory that is not an experiment.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
N = 3
MAX_NEW = 20


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.launcher.config import load_config, save_resolved
    from tandem.rollout.tiny_model import init_tiny
    from tandem.services.protocol import ExpDir
    from tandem.trainer import checkpoint

    root = tmp_path_factory.mktemp("eval-ckpt")
    exp = ExpDir(root / "exp")
    cfg = load_config(None, ["experiment.name=eval-ckpt", f"experiment.model={tiny_model_dir}",
                             f"experiment.exp_dir={exp.root}", "rollout.dataset=synthetic:math",
                             f"rollout.max_new_tokens={MAX_NEW}", "reward.task=math", "reward.num_workers=1"])
    save_resolved(cfg, exp.root)
    trained = AutoModelForCausalLM.from_pretrained(init_tiny(root / "other-weights", seed=1))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for version, model in ((2, trained), (5, base)):
        state = {"backend": {"model": model.state_dict(), "optimizer": {}, "scheduler": {}}}
        checkpoint.save(exp.checkpoints, version, 0, state, {"version": version}, keep=5)
    torch.set_num_threads(1)
    return cfg, exp, trained, base


def greedy_answers(cfg, model, prompts) -> list[str]:
    import torch
    from transformers import AutoTokenizer

    from tandem.rollout.workflow import chat_prompt_ids
    tok = AutoTokenizer.from_pretrained(cfg.experiment.model)
    out = []
    for p in prompts:
        ids = chat_prompt_ids(tok, p.text)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
        out.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    return out


def eval_argv(exp, *args) -> list[str]:
    return [sys.executable, "-m", "tandem.launcher.cli", "eval", "--exp", str(exp.root), *map(str, args)]


def test_a_checkpoint_is_scored_on_a_server_of_its_own(run, tmp_path):
    from tandem.rollout.evaluation import held_out_prompts
    cfg, exp, trained, base = run
    answers_file = tmp_path / "answers.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(eval_argv(exp, "--checkpoint", "v2", "--n", N, "--answers", answers_file),
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answered 3/3" in proc.stderr and "graded 3/3" in proc.stderr, proc.stderr
    result = json.loads((exp.root / "eval-v2.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert result["checkpoint"] == "v2" and result["version"] == 2 and result["n"] == N
    assert result["accuracy"] == result["correct"] / N
    p = result["accuracy"]
    assert result["se"] == round(math.sqrt(p * (1 - p) / N), 4)
    assert result["seconds"] > 0 and result["max_new_tokens"] == MAX_NEW

    rows = [json.loads(line) for line in answers_file.read_text().splitlines()]
    prompts = held_out_prompts(cfg, N)
    assert [r["problem"] for r in rows] == [q.text for q in prompts]
    assert sum(r["correct"] for r in rows) == result["correct"]
    responses = [r["response"] for r in rows]
    assert responses == greedy_answers(cfg, trained, prompts)            # the checkpoint's weights
    assert responses != greedy_answers(cfg, base, prompts)               # not the base model's
    # Nothing left behind: the temporary model directory and the server are gone.
    assert not list(exp.root.glob(".eval-*"))
    assert (exp.logs / "eval-v2-gen.log").exists()
    assert not _processes_mentioning(str(exp.root))


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid() and "gen serve" in cmd:
            found.append(cmd)
    return found


def test_checkpoint_errors_are_clear(run, tmp_path):
    _, exp, _, _ = run
    proc = subprocess.run(eval_argv(exp, "--checkpoint", "v3"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no checkpoint for v3" in proc.stderr and "v2, v5" in proc.stderr, proc.stderr
    sharded = exp.checkpoints / "step-7"
    (sharded / "dist").mkdir(parents=True)
    try:
        proc = subprocess.run(eval_argv(exp, "--checkpoint", "latest"), capture_output=True, text=True, timeout=120)
    finally:
        import shutil
        shutil.rmtree(sharded)
    assert proc.returncode == 2 and "sharded checkpoint" in proc.stderr and "megatron" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "eval", "--exp", str(tmp_path), "--checkpoint", "v2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "experiment directory" in proc.stderr, proc.stderr
    assert not list(exp.root.glob(".eval-*"))


def test_versions_resolve_as_the_trainer_numbers_them(run):
    from tandem.trainer.hf_export import NoSuchCheckpoint, resolve
    _, exp, _, _ = run
    assert resolve(exp.checkpoints, "latest") == (5, exp.checkpoints / "step-5")
    assert resolve(exp.checkpoints, "v2")[0] == resolve(exp.checkpoints, "2")[0] == 2
    for bad in ("v-1", "two", "4"):
        with pytest.raises(NoSuchCheckpoint):
            resolve(exp.checkpoints, bad)


def test_an_ended_run_is_scored_on_its_final_weights(run, tmp_path, tiny_model_dir):
    """`tandem eval --exp` without --checkpoint on a run that has ended: its controller's
    announcement is left behind, of a process that is gone; the command does not wait on it but
    serves the newest weights the run published (v6, the *trained* weights: newer than the
    checkpoints v2 and v5) on a server of its own."""
    import shutil
    cfg, exp, trained, _ = run
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    exp.service_file("controller").parent.mkdir(parents=True, exist_ok=True)
    exp.service_file("controller").write_text(json.dumps({"address": "tcp://127.0.0.1:9", "pid": int(gone)}))
    published = exp.weights / "v6"
    trained.save_pretrained(published)
    for f in tiny_model_dir.iterdir():   # tokenizer and chat template, as the trainer publishes them
        if f.is_file() and not (published / f.name).exists():
            shutil.copy2(f, published / f.name)
    answers_file = tmp_path / "answers.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(eval_argv(exp, "--n", N, "--answers", answers_file), capture_output=True, text=True,
                              timeout=280, env=env)
    finally:
        shutil.rmtree(exp.weights)
        shutil.rmtree(exp.service_file("controller").parent)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "final policy" in proc.stderr and f"final weights, {published}" in proc.stderr, proc.stderr
    result = json.loads((exp.root / "eval-v6.json").read_text())
    assert result["version"] == 6 and result["n"] == N
    from tandem.rollout.evaluation import held_out_prompts
    responses = [json.loads(line)["response"] for line in answers_file.read_text().splitlines()]
    assert responses == greedy_answers(cfg, trained, held_out_prompts(cfg, N))
    assert not list(exp.root.glob(".eval-*")) and not _processes_mentioning(str(exp.root))


def test_an_ended_run_with_nothing_to_serve_is_said_in_one_line(run, tmp_path):
    from tandem.launcher.config import save_resolved
    cfg, _, _, _ = run
    save_resolved(cfg, tmp_path / "bare")
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "eval", "--exp", str(tmp_path / "bare")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tandem eval: {tmp_path / 'bare'}: no policy to evaluate: no published weights in "
        f"{tmp_path / 'bare' / 'weights'} and no checkpoint in {tmp_path / 'bare' / 'checkpoints'}")


def test_a_run_on_a_data_file_is_scored_on_a_held_out_file_given_with_dataset(run, tmp_path):
    """A run trained on a data file with no rollout.eval_dataset has no problem it surely never
    trained on: `tandem eval` says so and how to give one (`--dataset FILE`); with it, it scores."""
    import shutil

    from tandem.launcher.config import load_config, save_resolved
    from tandem.rollout.synthetic import generate
    from tandem.services.protocol import ExpDir

    cfg, exp, _, _ = run
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in generate("math", 20, 3)))
    held.write_text("".join(json.dumps(r) + "\n" for r in generate("math", 4, 4)))
    mine = ExpDir(tmp_path / "on-a-file")
    save_resolved(load_config(None, ["experiment.name=on-a-file", f"experiment.model={cfg.experiment.model}",
                                     f"experiment.exp_dir={mine.root}", f"rollout.dataset={train}",
                                     f"rollout.max_new_tokens={MAX_NEW}", "reward.num_workers=1"]), mine.root)
    shutil.copytree(exp.checkpoints / "step-2", mine.checkpoints / "step-2")
    proc = subprocess.run(eval_argv(mine, "--checkpoint", "v2", "--n", 2), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and f"tandem eval --exp {mine.root} --dataset FILE" in proc.stderr, proc.stderr
    proc = subprocess.run(eval_argv(mine, "--checkpoint", "v2", "--n", 2, "--dataset", held), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["n"] == 2
