"""A short RL run from Python: the tiny math model that `make train-math` warms up, 20 steps in
the background with its progress, then its held-out accuracy. key=value arguments override."""
import sys
import time

import tandem

exp = tandem.Experiment("configs/math-tiny.yaml", ["trainer.total_steps=20", *sys.argv[1:]])
exp.set("experiment.exp_dir", time.strftime("runs/math-python-%Y%m%d-%H%M%S"))
exp.check()                                       # tandem.ConfigError names every mistake
run = exp.start(output=exp.exp_dir / "launcher.console")
while run.running():
    p = run.progress()
    print(f"step {p['step']}/{p['total_steps']}, reward {p['reward_mean']}", flush=True)
    time.sleep(10)
summary = run.wait()                              # tandem.RunFailed if it did not finish
held_out = summary["eval"]
print(f"held-out accuracy {held_out['before']:.1%} -> {held_out['after']:.1%} (n={held_out['n']})")
