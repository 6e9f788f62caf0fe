"""Whether the run can learn, said while it runs: the trainer's rank 0 watches two signals.

A run can go on for many steps learning nothing and look busy all the while (issue 63: 40
steps at reward 0.00 without a word; a `dapo` run that admitted 1,745 groups in 7 minutes and
trained one step, because dynamic sampling dropped every group whose rewards were all equal).

- **No reward signal**: a step whose every group's samples got the same reward has nothing to
  learn from (with the group baseline every advantage is 0). After `no_signal_steps` such steps
  in a row the trainer warns, and again every as many steps after.
- **Groups rejected in a row**: the controller's admission ledger counts the groups their
  episode rejected (`RejectGroup`: dynamic sampling's all-equal groups, a prompt too long) since
  the last one that reached the trainer. The trainer reads it with each step and every
  `POLL_S` while it waits for data; it warns at `filtered_warn_batches` batches of
  `trainer.groups_per_step` groups, and at `max_filtered_batches` (verl's
  `max_num_gen_batches`, the cap its users know) it stops the run or goes on, as
  `on_max_filtered` says.

A warning is a `warning` record in metrics.jsonl (`kind`, `message`, `step`, `count`): the
launcher prints it beside the progress lines, and the report and `summary.json` list it; a
stop is also a `run_stopped` record with its reason. Each step record carries the figures
(`signal_groups`, `no_signal_steps`, `rejected_in_a_row`, `dynamic_filtered_groups`), so the
trackers chart them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

ON_MAX_FILTERED = ("stop", "continue")
POLL_S = 2.0   # while the trainer waits for data, how often it reads the controller's counters


@dataclass
class SignalsConfig:
    """When the run says it is not learning, and when dynamic sampling's drops stop it."""
    # Warn when this many steps in a row trained only groups whose samples all got the same
    # reward (nothing to learn: every advantage is 0 with the group baseline), and again every
    # as many steps after; 0 = never.
    no_signal_steps: int = 10
    # Warn when the episodes have rejected this many batches (of trainer.groups_per_step
    # groups) in a row: dynamic sampling (rollout.filter_all_equal) dropping every group because
    # all its rewards were equal, or prompts over rollout.max_prompt_tokens; 0 = never.
    filtered_warn_batches: int = 2
    # The cap on those batches in a row (verl's max_num_gen_batches); reaching it does what
    # on_max_filtered says; 0 = no cap.
    max_filtered_batches: int = 10
    # At the cap: stop (the trainer saves a checkpoint and ends the run, which says why and exits
    # 1) or continue (warn and go on generating).
    on_max_filtered: str = "stop"

    def problems(self) -> list[tuple[str, str]]:
        out = [(k, f"must be >= 0 (0 = off), got {getattr(self, k)}")
               for k in ("no_signal_steps", "filtered_warn_batches", "max_filtered_batches") if getattr(self, k) < 0]
        if self.on_max_filtered not in ON_MAX_FILTERED:
            out.append(("on_max_filtered", f"must be one of {list(ON_MAX_FILTERED)}, got {self.on_max_filtered!r}"))
        return out


def has_signal(group) -> bool:
    """Whether a group's samples got different rewards (something to prefer one over another)."""
    return len({t.reward for t in group.samples}) > 1


class LearningSignals:
    """Rank 0's watch over both signals. `metrics` writes the records; the `controller` each call
    is given (a ControllerLink) answers `admission()`; `filtering` says whether
    rollout.filter_all_equal is on (it only changes the words)."""

    def __init__(self, cfg: SignalsConfig, groups_per_step: int, metrics, filtering: bool, clock=time.monotonic):
        self.cfg, self.B, self.metrics, self.filtering, self.clock = cfg, groups_per_step, metrics, filtering, clock
        self.no_signal_steps = 0       # steps in a row whose groups all had equal rewards
        self.rejected_seen = 0         # the controller's rejected count at the last step (checkpointed)
        self.in_a_row = 0              # the controller's rejected_in_a_row, last read
        self._warned_rejections, self._cap_level = False, 0
        self._next_poll = 0.0
        self._pending: list[dict] = []   # records written by flush(): a step's after its step record
        self.stop_reason: str | None = None

    # ---- each step ------------------------------------------------------------------------
    def step_fields(self, groups, step: int, controller) -> dict:
        """The step record's figures for the groups step `step` trains. Its warnings wait for
        `flush()`, which the trainer calls once the step's record is written, so they follow it."""
        with_signal = sum(has_signal(g) for g in groups)
        self.no_signal_steps = 0 if with_signal else self.no_signal_steps + 1
        n = self.cfg.no_signal_steps
        if n and self.no_signal_steps and self.no_signal_steps % n == 0:
            rewards = sorted({t.reward for g in groups for t in g.samples})
            self.warn("no_reward_signal", step, self.no_signal_steps,
                      f"no reward signal for {self.no_signal_steps} steps: every trained group's samples got the same "
                      f"reward (this step: {', '.join(f'{r:g}' for r in rewards[:4])}), so every advantage is 0 and "
                      f"nothing is learned. The model may be always wrong (or always right) on this data: check the "
                      f"samples (trainer.samples), the reward and the task's difficulty")
        counts = self._read_counts(controller, step)
        filtered = None
        if counts is not None:
            filtered, self.rejected_seen = max(0, counts["rejected"] - self.rejected_seen), counts["rejected"]
        return {"signal_groups": with_signal, "no_signal_steps": self.no_signal_steps,
                "rejected_in_a_row": self.in_a_row,
                # groups their workflow rejected (dynamic sampling) since the last step; None: unknown
                "dynamic_filtered_groups": filtered}

    # ---- while waiting for data -----------------------------------------------------------
    def should_stop(self, step: int, controller) -> bool:
        """Read the controller's counters every POLL_S and act on them; True when the cap says
        stop (then `stop_reason` says why, recorded)."""
        now = self.clock()
        if now >= self._next_poll:
            self._next_poll = now + POLL_S
            self._read_counts(controller, step)
            self.flush()
        return self.stop_reason is not None

    def _read_counts(self, controller, step: int) -> dict | None:
        counts = controller.admission()
        if counts is None:
            return None
        last, self.in_a_row = self.in_a_row, int(counts.get("rejected_in_a_row", 0))
        if self.in_a_row < last:   # a group got through since the last reading: a new run of rejections
            self._warned_rejections, self._cap_level = False, 0
        self._check_rejections(step)
        return counts

    def _check_rejections(self, step: int) -> None:
        warn_at, cap = self.cfg.filtered_warn_batches * self.B, self.cfg.max_filtered_batches * self.B
        if self.in_a_row == 0:
            return
        what = (f"dynamic sampling (rollout.filter_all_equal) dropped {self.in_a_row} groups in a row: every one's "
                f"samples got the same reward, so the model is right on all of them or (most often) wrong on all "
                f"of them, and no step trains meanwhile" if self.filtering else
                f"the episodes rejected {self.in_a_row} groups in a row (prompts over rollout.max_prompt_tokens, "
                f"or the workflow's RejectGroup), and no step trains meanwhile")
        limit = f"trainer.signals.max_filtered_batches ({self.cfg.max_filtered_batches} batches of {self.B} groups)"
        if cap and self.in_a_row >= cap and self.cfg.on_max_filtered == "stop":
            if self.stop_reason is None:
                self.stop_reason = (f"{what}. That reached {limit}: the run stops. Start RL from a model that is "
                                    f"right on some of these problems (a warm-up, easier data), or set "
                                    f"trainer.signals.on_max_filtered=continue or max_filtered_batches=0 to go on")
                self.warn("rejected_cap", step, self.in_a_row, self.stop_reason)
                self._pending.append({"event": "run_stopped", "step": step, "reason": self.stop_reason})
        elif cap and self.in_a_row >= cap:
            level = self.in_a_row // cap * cap   # once at the cap, then at each multiple of it
            if level > self._cap_level:
                self._cap_level = level
                self.warn("rejected_cap", step, self.in_a_row,
                          f"{what}. That is past {limit}; going on (trainer.signals.on_max_filtered: continue)")
        elif warn_at and self.in_a_row >= warn_at and not self._warned_rejections:
            self._warned_rejections = True
            then = ("the run stops" if self.cfg.on_max_filtered == "stop" else "it says so again") if cap else ""
            self.warn("rejected_in_a_row", step, self.in_a_row,
                      f"{what}." + (f" At {cap} in a row {then} (trainer.signals.max_filtered_batches)" if cap else ""))

    def warn(self, kind: str, step: int, count: int, message: str) -> None:
        log.warning("%s", message)
        self._pending.append({"event": "warning", "kind": kind, "step": step, "count": count, "message": message})

    def flush(self) -> None:
        """Write the warnings (and a stop) noticed since the last call."""
        for record in self._pending:
            self.metrics.log(**record)
        self._pending = []
