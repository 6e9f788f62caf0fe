"""`reward.function` and `reward.url` are checked before anything starts: the config's own rules
(one of them, the spec's and the URL's shape) when it loads, and whether the function imports
and is callable by `tandem config check` / `tandem run`'s preflight (launcher/preflight.py) —
each problem one line naming `reward.function`, as a grader worker would only find out once
the run was up."""
from __future__ import annotations

import json

import pytest
from model_dirs import checked_model_dir

from tandem.launcher.config import ConfigError, load_config_traced
from tandem.launcher.preflight import check_before_launch
from tandem.reward.config import RewardConfig
from tandem.reward.user_function import RewardFunctionError, load_reward_function

CONFIG = """\
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
  tp_size: 1
rollout:
  dataset: {dataset}
reward:
  function: {function}
"""


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package `byo_rewards` on the path with a good function, a constant and a broken module."""
    pkg = tmp_path / "pkg" / "byo_rewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("SCALE = 2\n\ndef score(prompt, response, row):\n    return 1.0\n")
    (pkg / "broken.py").write_text("import json\nraise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    return pkg


@pytest.mark.parametrize("overrides, key, message", [
    ({"function": "m:f", "url": "http://127.0.0.1:9/r"}, "function", "set reward.function or reward.url, not both"),
    ({"function": "my_rewards.score"}, "function", "must look like 'package.module:function'"),
    ({"function": "pkg.mod:fn()"}, "function", "must look like"),
    ({"url": "ftp://host/r"}, "url", "must be an http:// or https:// URL with a host"),
    ({"url": "http://"}, "url", "with a host"),
    ({"url": "http://[::1"}, "url", "with a host"),
    ({"function_timeout_s": 0.0}, "function_timeout_s", "must be > 0"),
    ({"url": "https://rm.example/score", "url_retries": -1}, "url_retries", "must be >= 0"),
])
def test_the_configs_own_rules(overrides, key, message):
    problems = RewardConfig(**overrides).problems()
    assert any(k == key and message in m for k, m in problems), problems


def test_a_good_function_and_url_pass_the_configs_rules():
    assert RewardConfig(function="examples.custom_reward.reward:score").problems() == []
    assert RewardConfig(url="http://127.0.0.1:8000/reward", url_retries=0).problems() == []


def test_load_names_what_is_wrong(user_package):
    assert load_reward_function("byo_rewards.good:score")("p", "r", {}) == 1.0
    cases = {
        "byo_rewards.missing:score": "no module named 'byo_rewards.missing'",
        "nowhere_at_all.rewards:score": "no module named 'nowhere_at_all'",
        "byo_rewards.good:scor": "module 'byo_rewards.good' has no attribute 'scor'",
        "byo_rewards.good:SCALE": "byo_rewards.good.SCALE is a int, not a function",
        "byo_rewards.broken:score": "importing 'byo_rewards.broken' failed: RuntimeError: needs a GPU",
    }
    for spec, why in cases.items():
        with pytest.raises(RewardFunctionError, match="^" + repr(spec).replace(".", r"\.") + ": ") as e:
            load_reward_function(spec)
        assert why in str(e.value), (spec, str(e.value))


def _check(tmp_path, function: str):
    model = checked_model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    path = tmp_path / "exp.yaml"
    path.write_text(CONFIG.format(model=model, dataset=data, exp_dir=tmp_path / "run", function=function))
    cfg, prov = load_config_traced(path, [])
    check_before_launch(cfg, prov)
    return path


def test_config_check_refuses_a_function_that_does_not_import_naming_the_key_and_line(tmp_path, user_package):
    _check(tmp_path, "byo_rewards.good:score")              # passes
    for spec, why in (("byo_rewards.good:nope", "has no attribute 'nope'"),
                      ("byo_rewards.absent:score", "no module named 'byo_rewards.absent'"),
                      ("byo_rewards.good:SCALE", "not a function")):
        with pytest.raises(ConfigError) as e:
            _check(tmp_path, spec)
        path = tmp_path / "exp.yaml"
        line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "function:" in text)
        assert str(e.value).startswith(f"{path}:{line}: reward.function: '{spec}': "), str(e.value)
        assert why in str(e.value)


def test_the_example_function_passes_the_check_from_the_checkout(tmp_path):
    # `tandem` runs from the checkout: the example imports as the roles started there import it.
    _check(tmp_path, "examples.custom_reward.reward:score")
    _check(tmp_path, "examples.custom_reward.builtin_math:grade")
