"""The trainer's side of the simulation and the controller's weight syncs (a mixin of
`Simulation`, engine.py, which owns the servers and admission).

The trainer takes the B oldest graded groups, trains for the step's cost, publishes, and waits
for the servers' loads (trainer.wait_for_ack) or goes on. Syncs run one at a time, as the
controller's lock runs them: a sync brings every server to its target version (interrupting or
draining it, engine.py) and the controller's version moves when the last one holds it. Without
coalescing the trainer's next publish waits for the sync in progress; with coalesced versions
(trainer/announcements.py) it publishes during a sync, as far ahead as `trainer.keep_weights`
allows, the newest version published meanwhile waits (superseding older ones), and the next
sync takes the servers straight to it.
"""
from __future__ import annotations

import heapq

from tandem.trainer.announcements import oldest_allowed

# Event kinds (engine.py dispatches them).
SERVER, LOAD_DONE, GRADED, TRAIN_DONE, PUBLISH_DONE, TRAINER_FREE, ADMIT = range(7)


class TrainerSide:
    def _graded(self, gid: int, t: float) -> None:
        heapq.heappush(self.buffer, (self.groups[gid].admit_version, gid))
        self._try_train(t)

    def _try_train(self, t: float) -> None:
        B = self.s.groups_per_step
        if self.trainer_busy or len(self.buffer) < B:
            return
        tokens = sq = 0.0
        for _ in range(B):
            _, gid = heapq.heappop(self.buffer)
            g = self.groups.pop(gid)
            tokens += g.tokens
            sq += g.sum_sq
            self.staleness[self.version - g.admit_version] += 1
            self.token_staleness[self.version - g.min_version] += 1
        dur = self.c.train_step_s(tokens, sq)
        self.trainer_busy = True
        self.train_busy.append(dur)
        self.trained_tokens.append(tokens)
        self._push(t + dur, TRAIN_DONE)

    def _train_done(self, t: float) -> None:
        self.steps_done += 1
        self.step_times.append(t)
        if self.steps_done == self.s.warmup_steps:
            self._snapshot(t)
        if self.unacked and not self._room_to_publish():
            # Without wait_for_ack the trainer went on, but it cannot publish again before
            # every server has loaded the previous version (or, coalescing, the version the
            # publish would prune from the disk).
            self.on_ack = PUBLISH_DONE
        else:
            self._push(t + self.c.publish_s, PUBLISH_DONE)

    def _room_to_publish(self) -> bool:
        """Coalescing, during a sync: whether publishing the next version keeps the sync's
        version and the one waiting on disk (trainer/announcements.py: Announcements.make_room)."""
        s = self.s
        return s.coalesce_versions and s.keep_weights > 1 and \
            self.target >= oldest_allowed(self.version + 1, s.keep_weights)

    def _publish_done(self, t: float) -> None:
        self.version += 1
        if self.unacked:
            self.pending = self.version   # supersedes the one waiting before it, if any
        else:
            self._start_sync(self.version, t)
        if self.s.wait_for_ack:
            self.on_ack = TRAINER_FREE
        else:
            self._step_finished(t)

    def _start_sync(self, version: int, t: float) -> None:
        self.target = version
        self.syncs += 1
        self.unacked = set(range(len(self.servers)))
        for srv in self.servers:
            self._update_server(srv, t)

    def _version_synced(self, t: float) -> None:
        """Every server holds the new version: the controller moves on (admission follows it),
        acknowledges the trainer and starts the sync of the newest version waiting, if any."""
        self.ctl_version = self.target
        if self.s.admit_delay_s and self.eta_blocked:
            self._push(t + self.s.admit_delay_s, ADMIT)
        else:
            self._admit_groups(t)
        if self.pending > self.target:
            self._start_sync(self.pending, t)
        self.pending = 0
        then, self.on_ack = self.on_ack, None
        if then == PUBLISH_DONE:
            self._push(t + self.c.publish_s, PUBLISH_DONE)
        elif then == TRAINER_FREE:
            self._step_finished(t)

    def _step_finished(self, t: float) -> None:
        """Published (and acknowledged, when the trainer waits for that): checkpoint, go on."""
        every = self.s.checkpoint_every
        if every and self.version % every == 0:
            self._push(t + self.c.checkpoint_s, TRAINER_FREE)
        else:
            self._trainer_free(t)

    def _trainer_free(self, t: float) -> None:
        self.trainer_busy = False
        self._try_train(t)
