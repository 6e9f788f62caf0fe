"""The reward service's part of the experiment config (section `reward`)."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# `package.module:function` (reward/user_function.py imports it; `tandem config check` tries).
FUNCTION_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


@dataclass
class RewardConfig:
    """Graders (math, sandboxed code) and the reward service that runs them."""
    # The task of this experiment's prompts, math or code (each request item also names its own).
    task: str = "math"
    # Reward of a correct response.
    correct_reward: float = 5.0
    # Reward of a wrong, unparsable, failing or timed-out response.
    wrong_reward: float = -5.0
    # Your own reward instead of the math/code grader: `package.module:function` (sync or async),
    # called in the grader workers as fn(prompt, response, row) and returning a number, or a map
    # {"reward": number, "correct": bool, ...details} (either key may be left out). A reward
    # must lie within [wrong_reward, correct_reward]; one that raises, times out, or returns NaN,
    # inf, a bool or a value out of range gets wrong_reward, counted (docs/reward.md, "Your own
    # reward"). "" = the built-in grader of `task`.
    function: str = ""
    # Or a remote reward endpoint: POST JSON {prompt, response, row} to this http(s) URL, which
    # answers what `function` returns, as JSON. "" = none; at most one of function and url.
    url: str = ""
    # Seconds one call of `function`, or one attempt at `url`, may take (then: wrong_reward,
    # reason "timeout").
    function_timeout_s: float = 10.0
    # Further attempts at `url` after a connection error, a timeout, a 429 or a 5xx reply (0.5 s,
    # 1 s, 2 s ... apart).
    url_retries: int = 2
    # Grader worker processes in the service's pool (a crashed or hung one is replaced).
    num_workers: int = 2
    # Verdicts remembered by content (task, response, reference, tests): an identical item, e.g.
    # a sample repeating another of its group, gets the remembered verdict instead of another
    # grading (a sandbox run for code); 0 = grade every item (reward/verdict_cache.py).
    verdict_cache: int = 4096
    # Interface the service listens on.
    host: str = "127.0.0.1"
    # 0 = pick a free port and publish it in <exp>/services/reward.json.
    port: int = 0
    # Math: with true, a response without \boxed{} is wrong; with false, math-verify extracts the
    # final expression of the answer text instead (see docs/reward.md, "No box").
    math_require_box: bool = False
    # Math: seconds one verdict may take (sympy can be slow on pathological input).
    math_timeout_s: float = 5.0
    # Code: seconds of wall time for one test case.
    code_test_timeout_s: float = 5.0
    # Code: seconds of wall time for all the tests of one task together.
    code_total_timeout_s: float = 30.0
    # Code: address-space limit of the program, in MiB.
    code_memory_mb: int = 1024
    # Code: processes the program may run at once (fork bombs hit this limit).
    code_max_processes: int = 16
    # Code: largest file the program may write, in MiB.
    code_max_file_mb: int = 16
    # Code: MiB all the program's files may hold at once (its working directory and /tmp are a
    # tmpfs of this size inside the sandbox; nothing is written to the host's disk).
    code_max_disk_mb: int = 64
    # Code: bytes of stdout/stderr captured per test; a program printing more fails the test.
    code_max_output_bytes: int = 1_000_000
    # Code: false = the reward is correct_reward only when every test passes; true = wrong_reward
    # plus the passed fraction of (correct_reward - wrong_reward).
    code_partial_credit: bool = False
    # Code isolation: auto (bubblewrap when it works, else rlimits only, logged loudly), bwrap
    # (refuse to run code without it) or rlimits (never use bubblewrap).
    sandbox: str = "auto"
    # Code: one cgroup per task bounds the memory (and, on cgroup v2, the processes) of the whole
    # sandbox, where the grader can make one (reward/sandbox_cgroup.py); false: per-process
    # limits and the harness's 20 ms watch of the whole sandbox instead (faster to start).
    sandbox_cgroup: bool = True
    # Code: programs run as user id sandbox_uid_base + (worker pid mod 10000) when the grader
    # is root, so the process limit applies and root's files stay unreadable.
    sandbox_uid_base: int = 200000
    # Code: packages the graded programs may import beyond the standard library (bound
    # read-only into the sandbox as this interpreter finds them, e.g. [numpy]).
    sandbox_packages: list[str] = field(default_factory=list)
    # Code: grade even without bubblewrap (the program can then read the host's files and reach
    # the network, so a policy can learn to fetch its tests); false = refuse, naming why.
    allow_unisolated: bool = False

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.task not in ("math", "code"):
            out.append(("task", f"must be 'math' or 'code', got {self.task!r}"))
        if self.function and self.url:
            out.append(("function", "set reward.function or reward.url, not both"))
        if self.function and not FUNCTION_SPEC.fullmatch(self.function):
            out.append(("function", f"must look like 'package.module:function', got {self.function!r}"))
        if self.url:
            try:
                parts = urlsplit(self.url)
                ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            except ValueError:    # e.g. an unclosed [ipv6 bracket
                ok = False
            if not ok:
                out.append(("url", f"must be an http:// or https:// URL with a host, got {self.url!r}"))
        if self.url_retries < 0:
            out.append(("url_retries", "must be >= 0"))
        if self.num_workers < 1:
            out.append(("num_workers", "must be >= 1"))
        if self.verdict_cache < 0:
            out.append(("verdict_cache", "must be >= 0 (0 = grade every item)"))
        if self.sandbox not in ("auto", "bwrap", "rlimits"):
            out.append(("sandbox", f"must be auto, bwrap or rlimits, got {self.sandbox!r}"))
        for key in ("math_timeout_s", "code_test_timeout_s", "code_total_timeout_s", "function_timeout_s"):
            if getattr(self, key) <= 0:
                out.append((key, "must be > 0"))
        for key in ("code_memory_mb", "code_max_processes", "code_max_file_mb", "code_max_disk_mb",
                    "code_max_output_bytes"):
            if getattr(self, key) < 1:
                out.append((key, "must be >= 1"))
        for name in self.sandbox_packages:
            if not isinstance(name, str) or not name.isidentifier() or importlib.util.find_spec(name) is None:
                out.append(("sandbox_packages", f"{name!r} is not a package this Python can import"))
        if self.correct_reward <= self.wrong_reward:
            out.append(("correct_reward", f"must be greater than wrong_reward ({self.wrong_reward})"))
        return out
