"""`tandem eval --exp DIR --checkpoint vN`: greedy held-out accuracy of one trainer checkpoint.

`tandem eval` without `--checkpoint` scores whatever the run's servers hold now; a checkpoint is
a past policy that no server holds, and (once the run is over) there may be no server at all. So
this builds the checkpoint's model as a Hugging Face directory (`python -m tandem.trainer.hf_export`,
its own process: the trainer owns its checkpoint format), starts a private embedded server on it
(`tandem gen serve`, no `--exp`: the run's service files and logs stay untouched; a random API
key), and asks it the held-out problems through `/v1/chat/completions` — the OpenAI-compatible
route a user's own harness would use, so this command is also that route's end-to-end check —
greedy, with the run's `rollout.max_new_tokens`. Answers are graded in this process by the reward
package's grader pool (as `tandem reward grade` does), with the run's `reward` settings. The
problems, prompt (the chat template of one user turn) and grading are those of the run's own
held-out evaluation (`rollout/evaluation.py`), so the figures compare.

`--checkpoint final` (what `tandem eval --exp` does when the run's servers are gone: the run
ended) serves the run's final policy: the newest weights it published (`<exp>/weights/v<N>/`,
already a Hugging Face directory, so nothing is converted, or a LoRA adapter directory merged
onto the base model) unless a checkpoint is newer. A run
that left neither is said in one line.

The server and the temporary model directory (under `<exp>/`, where the run's storage is) are
removed whatever happens: an error, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tandem.services.protocol import ExpDir, GradeItem, numbered_dirs, write_json_atomic

SERVER_START_TIMEOUT_S = 600.0
EXPORT_TIMEOUT_S = 1800.0


FINAL = "final"


class EvalError(RuntimeError):
    """A problem the user can fix (said in the message); `tandem eval` exits 2."""


def say(msg: str) -> None:
    print(f"tandem eval: {msg}", file=sys.stderr, flush=True)


async def export_checkpoint(exp: ExpDir, spec: str, base_model: str, out: Path,
                            adapter_dir: Path | None = None) -> tuple[int, str]:
    """(version, checkpoint dir) after writing the HF directory `out`; with `adapter_dir`, that
    published LoRA adapter directory merged onto `base_model` instead of a checkpoint."""
    source = (["--adapter-dir", str(adapter_dir)] if adapter_dir is not None else
              ["--checkpoints", str(exp.checkpoints), "--version", spec])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.trainer.hf_export", *source,
        "--model", str(base_model), "--out", str(out), "--weights", str(exp.weights),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), EXPORT_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode in (2, 3):
        raise EvalError(stderr.decode().strip().splitlines()[-1])
    if proc.returncode != 0:
        raise RuntimeError(f"converting the checkpoint failed:\n{stderr.decode()[-3000:]}")
    info = json.loads(stdout.decode().strip().splitlines()[-1])
    return int(info["version"]), info["checkpoint"]


def is_adapter_dir(path: Path) -> bool:
    """A LoRA adapter publication (`trainer.lora.sync: adapter`): merged onto the base model
    before serving (the trainer's hf_export does it, as for a checkpoint)."""
    return (path / "adapter_config.json").is_file()


def final_policy(exp: ExpDir) -> tuple[int, Path | None]:
    """(version, its published HF directory or None: export the checkpoint of that version).

    The newest published weights win ties: serving them converts nothing (and works for a
    Megatron run, whose sharded checkpoints do not convert here)."""
    published = [v for v in numbered_dirs(exp.weights, "v") if (exp.weights / f"v{v}" / "config.json").exists()
                 or is_adapter_dir(exp.weights / f"v{v}")]
    checkpoints = numbered_dirs(exp.checkpoints, "step-")
    if not published and not checkpoints:
        raise EvalError(f"{exp.root}: no policy to evaluate: no published weights in {exp.weights} "
                        f"and no checkpoint in {exp.checkpoints}")
    if published and (not checkpoints or published[-1] >= checkpoints[-1]):
        return published[-1], exp.weights / f"v{published[-1]}"
    return checkpoints[-1], None


async def model_for(exp: ExpDir, spec: str, base_model: str, tmp: Path) -> tuple[int, Path, str]:
    """(version, HF directory to serve, what it is) for `--checkpoint spec` (vN, N, latest, final)."""
    if spec == FINAL:
        version, published = final_policy(exp)
        if published is not None and is_adapter_dir(published):   # trainer.lora.sync: adapter
            await export_checkpoint(exp, spec, base_model, tmp / "model", adapter_dir=published)
            return version, tmp / "model", f"the run's final weights, {published}, merged onto {base_model}"
        if published is not None:
            return version, published, f"the run's final weights, {published}"
        spec = f"v{version}"
    version, ckpt = await export_checkpoint(exp, spec, base_model, tmp / "model")
    return version, tmp / "model", f"{ckpt} as a Hugging Face model"


class PrivateServer:
    """`tandem gen serve` on the exported model, found by the `serving on URL` line it prints."""

    def __init__(self, model: Path, workdir: Path, log_path: Path, threads: int, max_running: int):
        self.model, self.workdir, self.log_path = model, workdir, log_path
        self.threads, self.max_running = threads, max_running
        self.key = secrets.token_urlsafe(24)
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> str:
        key_file = self.workdir / "api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.key + "\n")
        argv = [sys.executable, "-m", "tandem.launcher.cli", "gen", "serve", "--model", str(self.model), "--port", "0",
                "--host", "127.0.0.1", "--api-key-file", str(key_file), "--max-running", str(self.max_running)]
        if self.threads:
            argv += ["--threads", str(self.threads)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=log,
                                                             start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            if line.startswith(b"serving on "):
                self.url = line.decode().split()[2]
                return self.url
            if not line:    # the server exited
                break
        raise RuntimeError(f"the generation server did not start (log {self.log_path}):\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def answer_all(server: PrivateServer, prompts, max_tokens: int, concurrency: int) -> list[dict]:
    """Each prompt's greedy answer from `/v1/chat/completions`: `{text, finish_reason}`."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    done = 0
    every = max(1, len(prompts) // 10)
    headers = {"Authorization": f"Bearer {server.key}"}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=3600)

    async def one(session, p) -> dict:
        nonlocal done
        body = {"model": "checkpoint", "messages": p.messages(), "temperature": 0.0,
                "max_tokens": max_tokens}
        async with sem, session.post(server.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200:
                raise EvalError(f"the server refused a problem ({resp.status}): "
                                f"{reply.get('message', reply) if isinstance(reply, dict) else reply}")
        choice = reply["choices"][0]
        done += 1
        if done % every == 0 or done == len(prompts):
            say(f"answered {done}/{len(prompts)}")
        return {"text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"]}

    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return list(await asyncio.gather(*(one(session, p) for p in prompts)))
    except aiohttp.ClientError as e:
        raise RuntimeError(f"lost the generation server ({e}); its log ({server.log_path}):\n"
                           f"{server.log_tail()}") from None


async def grade_all(reward_cfg, prompts, answers: list[dict]) -> list:
    from tandem.reward.pool import GraderPool
    from tandem.rollout.workflow import grade_item

    pool = GraderPool(reward_cfg)
    await pool.start()
    items: list[GradeItem] = [grade_item(p, a["text"]) for p, a in zip(prompts, answers, strict=True)]
    verdicts = []
    try:
        for k in range(0, len(items), 64):
            batch = items[k:k + 64]
            verdicts += await pool.grade(batch, 64 * max(pool.hard_limit_s(batch[0].task), 1.0))
    finally:
        await pool.close()
    say(f"graded {len(verdicts)}/{len(items)}")
    return verdicts


async def evaluate_checkpoint(cfg, exp: ExpDir, spec: str, n: int, out: Path | None, threads: int = 0,
                              concurrency: int = 32, answers_path: Path | None = None) -> dict:
    from tandem.rollout.evaluation import held_out_prompts, standard_error

    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(dir=exp.root, prefix=".eval-"))
    server = None
    try:
        # Before the checkpoint is converted (a process of its own that imports torch): a refusal
        # for want of problems comes at once.
        prompts = held_out_prompts(cfg, n)
        if not prompts:
            raise EvalError(f"no held-out problems: every problem of rollout.dataset ({cfg.rollout.dataset}) may "
                            f"have been trained on and the run has no rollout.eval_dataset; give one: "
                            f"tandem eval --exp {exp.root} --dataset FILE")
        version, model_dir, what = await model_for(exp, spec, cfg.experiment.model, tmp)
        say(f"v{version}: {what} ({time.time() - t0:.1f} s)")
        server = PrivateServer(model_dir, tmp, exp.logs / f"eval-v{version}-gen.log", threads,
                               max_running=concurrency)
        say(f"generation server on {await server.start()}; {len(prompts)} problems, greedy, "
            f"max_tokens {cfg.rollout.max_new_tokens}")
        answers = await answer_all(server, prompts, cfg.rollout.max_new_tokens, concurrency)
        await server.stop()
        verdicts = await grade_all(cfg.reward, prompts, answers)
    finally:
        if server is not None:
            await server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    correct = sum(bool(v.correct) for v in verdicts)
    result = {"checkpoint": f"v{version}", "version": version, "accuracy": correct / len(prompts),
              "n": len(prompts), "correct": correct, "se": round(standard_error(correct, len(prompts)), 4),
              "truncated": sum(a["finish_reason"] == "length" for a in answers),
              "max_new_tokens": cfg.rollout.max_new_tokens, "model": str(cfg.experiment.model),
              "seconds": round(time.time() - t0, 1)}
    path = Path(out) if out else exp.root / f"eval-v{version}.json"
    write_json_atomic(path, result)
    if answers_path:
        write_answers(Path(answers_path), prompts, answers, verdicts)
    say(f"v{version}: {correct}/{len(prompts)} correct ({result['accuracy']:.1%} ± {result['se']:.1%}); "
        f"wrote {path}")
    return result


def write_answers(path: Path, prompts, answers: list[dict], verdicts: list) -> None:
    """One JSON line per problem: what was asked, answered and expected, and the verdict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, (p, a, v) in enumerate(zip(prompts, answers, verdicts, strict=True)):
            f.write(json.dumps({"index": i, "problem": p.text, "reference": p.reference, "response": a["text"],
                                "finish_reason": a["finish_reason"], "correct": bool(v.correct),
                                "reward": v.reward}) + "\n")


def cmd_eval_checkpoint(args) -> int:
    exp = ExpDir(args.exp)
    n = args.n or args.cfg.rollout.eval_size or 100

    async def main() -> dict:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)   # clean up as on Ctrl-C
        return await evaluate_checkpoint(args.cfg, exp, args.checkpoint, n, args.out,
                                         threads=getattr(args, "threads", 0) or 0,
                                         answers_path=getattr(args, "answers", None))

    try:
        result = asyncio.run(main())
    except EvalError as e:
        say(str(e))
        return 2
    except asyncio.CancelledError:
        say("stopped")
        return 143
    print(json.dumps(result))
    return 0
