"""What a launch checks before anything starts (launcher/preflight.py): the layout `tandem plan`
refuses, the data sets, the model, the episode function — each one `where: key: message` line,
from `tandem config check` and from `tandem run`'s prepare alike, before the experiment
directory exists (so before any SLURM job is submitted).

The model here is what the check reads of one (tests/support/model_dirs.py): a config, a weights
file and a tokenizer, with no weights in them — the check reads the files, it does not load the
weights (the roles do that)."""
from __future__ import annotations

import json

import pytest
from model_dirs import checked_model_dir

from tandem.launcher.config import ConfigError, load_config_traced
from tandem.launcher.preflight import check_before_launch
from tandem.launcher.run import prepare

CLUSTER = """\
experiment:
  name: pre
  model: {model}
  exp_dir: {exp_dir}
launcher:
  backend: slurm
  nodes: 2
  gpus_per_node: 8
gen:
  backend: sglang
  tp_size: 1
rollout:
  dataset: {dataset}
"""


@pytest.fixture
def files(tmp_path):
    model = checked_model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    return model, data


def _write(tmp_path, model, dataset, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(CLUSTER.format(model=model, dataset=dataset, exp_dir=tmp_path / "run"))
    return path


def _check(path, *overrides):
    cfg, prov = load_config_traced(path, list(overrides))
    check_before_launch(cfg, prov)
    return cfg


def _line(path, needle):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_a_good_cluster_file_passes_and_gets_its_server_count(tmp_path, files):
    cfg = _check(_write(tmp_path, *files))
    assert cfg.gen.num_servers == 12   # 16 GPUs at 3:1, one server per GPU


def test_the_plans_layout_check_runs_with_the_file_line(tmp_path, files):
    path = _write(tmp_path, *files)
    path.write_text(path.read_text().replace("tp_size: 1", "tp_size: 3"))
    with pytest.raises(ConfigError) as e:
        _check(path)
    assert str(e.value) == (f"{path}:{_line(path, 'tp_size: 3')}: gen.tp_size=3 does not divide "
                            f"launcher.gpus_per_node=8: some tensor-parallel group would straddle two nodes")
    with pytest.raises(ConfigError, match=r"^command line: gen\.tp_size=16 is larger than a node"):
        _check(path, "gen.tp_size=16")


def test_a_missing_or_unusable_data_set_is_refused(tmp_path, files):
    model, data = files
    path = _write(tmp_path, model, tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError) as e:
        _check(path)
    assert str(e.value) == f"{path}:{_line(path, 'dataset:')}: rollout.dataset: {tmp_path / 'nope.jsonl'}: no such file or directory"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?"}\nnot json\n')   # a math row without its answer, then no row
    with pytest.raises(ConfigError, match=r"command line: rollout\.dataset: no usable math row in the first 2: "
                                          r".*bad\.jsonl:1: math row has no 'answer'$"):
        _check(path, f"rollout.dataset={bad}")
    bad.write_text(bad.read_text() + data.read_text())   # the workers skip bad rows: one usable is enough
    _check(path, f"rollout.dataset={bad}")
    with pytest.raises(ConfigError, match=r"rollout\.eval_dataset: .*missing\.jsonl: no such file"):
        _check(_write(tmp_path, model, data), f"rollout.eval_dataset={tmp_path / 'missing.jsonl'}")


def test_what_the_run_generates_is_not_refused(tmp_path, files):
    model, _ = files
    _check(_write(tmp_path, model, "synthetic:math"))
    with pytest.raises(ConfigError, match="unknown synthetic task 'chess'"):
        _check(_write(tmp_path, model, "synthetic:chess"))


def test_the_model_and_the_episode_function_are_checked(tmp_path, files):
    model, data = files
    path = _write(tmp_path, tmp_path / "no-model", data)
    with pytest.raises(ConfigError, match=r"experiment\.model: .*no-model does not exist$"):
        _check(path)
    with pytest.raises(ConfigError, match=r"^command line: rollout\.workflow: cannot import 'no_such_module'"):
        _check(_write(tmp_path, model, data), "rollout.workflow=no_such_module:episode")
    with pytest.raises(ConfigError, match=r"rollout\.workflow: tandem\.rollout\.workflow has no function 'nope'"):
        _check(_write(tmp_path, model, data), "rollout.workflow=tandem.rollout.workflow:nope")


def test_a_hub_name_where_a_path_belongs_is_refused_saying_how_to_bring_it(tmp_path, files):
    """Runs read local files only (no network on the nodes): `owner/name` that is no path gets
    the line that downloads it, for the data set and the model; a missing file path does not."""
    model, data = files
    path = _write(tmp_path, "Qwen/Qwen2.5-0.5B", "openai/gsm8k")
    with pytest.raises(ConfigError) as e:
        _check(path)
    text = str(e.value)
    assert "openai/gsm8k: no such file or directory; a Hugging Face Hub name? runs read local files only: " \
           "save it once where the network is, datasets.load_dataset('openai/gsm8k', split=...).save_to_disk(DIR)" in text
    assert "Qwen/Qwen2.5-0.5B does not exist; a Hugging Face Hub name? runs load local directories only: " \
           "download it once where the network is, huggingface_hub.snapshot_download('Qwen/Qwen2.5-0.5B', " \
           "local_dir=DIR), and give DIR" in text
    with pytest.raises(ConfigError) as e:
        _check(_write(tmp_path, model, "data/x.parquet"))
    assert str(e.value).endswith("data/x.parquet: no such file or directory")


def _shard_lost(model):
    """A sharded model whose copy stopped before its second shard."""
    (model / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")


@pytest.mark.parametrize("damage, why", [
    (lambda m: (m / "config.json").unlink(), r"has no config\.json, so it is not a Hugging Face model directory "
                                             r"\(it holds: model\.safetensors, tokenizer\.json\)"),
    (lambda m: (m / "config.json").write_text("{"), r"config\.json cannot be read as JSON"),
    (lambda m: (m / "config.json").write_text("{}"), r"config\.json names no model_type"),
    (lambda m: (m / "model.safetensors").unlink(), r"holds no weights"),
    (_shard_lost, r"1 of the 2 weight files model\.safetensors\.index\.json lists are missing "
                  r"\(first: model-00002-of-00002\.safetensors\); an interrupted download or copy\?"),
    (lambda m: (m / "tokenizer.json").unlink(), r"has no tokenizer"),
])
def test_a_model_directory_the_roles_could_not_load_is_refused_saying_why(tmp_path, files, damage, why):
    """Before, any existing path passed, and the roles failed on it after they started (on SLURM,
    after the queue): the parent of the model directory, a copy without its last shard."""
    model, data = files
    _check(_write(tmp_path, model, data))
    damage(model)
    with pytest.raises(ConfigError, match=r"experiment\.model: .*" + why):
        _check(_write(tmp_path, model, data))


def test_every_problem_is_said_at_once(tmp_path, files):
    model, _ = files
    path = _write(tmp_path, tmp_path / "no-model", tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError) as e:
        _check(path, "gen.tp_size=3")
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert [ln.split(": ")[1].split("=")[0] for ln in lines[1:]] == ["gen.tp_size", "rollout.dataset", "experiment.model"]


def test_run_refuses_before_the_experiment_directory_exists(tmp_path, files):
    """`tandem run` (either backend: the SLURM one submits only after prepare) stops here."""
    model, _ = files
    path = _write(tmp_path, model, tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="rollout.dataset"):
        prepare(str(path), [], resume=False)
    assert not (tmp_path / "run").exists()


def test_a_resume_may_move_the_model_but_not_change_its_architecture(tmp_path, files):
    """The checkpoint holds the first model's tensors: another shape is refused before anything
    starts (and before the directory is touched), naming what differs; the same model elsewhere
    (a moved directory) resumes."""
    model, data = files
    shape = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}
    (model / "config.json").write_text(json.dumps(shape))
    path = _write(tmp_path, model, data)
    local = ["launcher.backend=local", "launcher.nodes=1", "gen.backend=embedded", "gen.num_servers=1"]
    prepare(str(path), local, resume=False)
    moved, other = checked_model_dir(tmp_path / "moved"), checked_model_dir(tmp_path / "other")
    (moved / "config.json").write_text(json.dumps(shape))
    (other / "config.json").write_text(json.dumps({**shape, "hidden_size": 96, "num_hidden_layers": 3}))
    before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"another architecture .* hidden_size 64 -> 96, num_hidden_layers 2 -> 3"):
        prepare(str(path), [*local, f"experiment.model={other}"], resume=True)
    assert (tmp_path / "run" / "config.yaml").read_text() == before
    prepare(str(path), [*local, f"experiment.model={moved}"], resume=True)


def test_an_experiment_directory_that_cannot_be_made_is_named(tmp_path, files):
    model, data = files
    (tmp_path / "a-file").write_text("")
    path = _write(tmp_path, model, data)
    with pytest.raises(ConfigError, match=r"^experiment\.exp_dir: cannot create .*a-file/exp: Not a directory$"):
        prepare(str(path), ["launcher.backend=local", "launcher.nodes=1", "gen.backend=embedded", "gen.num_servers=1",
                            f"experiment.exp_dir={tmp_path / 'a-file' / 'exp'}"], resume=False, exclusive=True)
