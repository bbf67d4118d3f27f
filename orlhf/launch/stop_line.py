"""The last line of a run a signal stopped (launch/stop_signals.py): where it stopped, what is kept and the command
that continues from it, and the exit code (128 + the signal's number; 0 where the run was complete).

    stopped by SIGTERM during step 7: checkpoint <ckpt_path>/step_000007 kept; run the same command with
    --load_checkpoint to continue from it
"""

from __future__ import annotations

import logging
import re
import signal
from typing import Any, Callable, Optional

log = logging.getLogger("orlhf")


class StopLine:
    """The wording of RunStop's last line, from what RunStop records of the stop (its fields below)."""

    attempt: Any  # the attempt in progress (launch/restart.Attempt: phase, controller, complete), or None
    checkpoints: Any  # the run's CheckpointManager, once the inputs are read
    signal: Optional[str]  # the first signal's name
    where: str  # where the signal that decided the stop came ("during step 7")
    at_once: bool  # it stopped now (the stop thread ended the run)
    forced: bool  # ... by a second signal
    _reason: str  # why a stop now came without a second signal

    def _line(self, code: Optional[int] = None, say: Optional[Callable[[str], Any]] = None) -> Optional[int]:
        """Log the run's last line (and `say` it: the terminal, when its logging is muted); the exit code."""
        if self.signal is None:
            return code
        if not self.at_once and self.where == "during the export" and code == 0:
            text = f"{self.signal} {self.where}: it finished first, so the run is complete; nothing to continue"
        elif self.at_once and self._complete():
            text = f"{self.signal} at the end of the run: the run is complete, only its teardown was cut short"
            code = 0
        else:
            self.where = self._stopped_where()
            how = f"at once by a second {self.signal}" if self.forced else f"by {self.signal}"
            unchanged = "the export was not written; " if self.where == "during the export" and self.at_once else ""
            text = f"stopped {how} {self.where}{self._reason}: {unchanged}{self.kept()}"
            code = 128 + int(signal.Signals[self.signal])
        log.warning("%s", text)
        if say is not None:
            say(f"[orlhf] {text}")
        return code

    def _complete(self) -> bool:
        return self.attempt is not None and getattr(self.attempt, "complete", False)

    def _stop_code(self) -> int:
        """The exit code of a stop now: 128 + the signal's number, 0 where the run had written its outputs."""
        return 0 if self._complete() else 128 + int(signal.Signals[self.signal])

    def _stopped_where(self) -> str:
        """Where the run stopped: the signal's phase; for a step the first signal let finish, the step the loop
        ended after (another one where the signal came as a step ended: the loop had just checked for one, or the
        stop thread read the step's number as the loop counted it)."""
        controller = self.attempt.controller if self.attempt is not None else None
        m = re.fullmatch(r"during (the checkpoint of )?step (\d+)", self.where)
        if self.at_once or controller is None or m is None or controller.step_index in (0, int(m.group(2))):
            return self.where
        return f"during step {controller.step_index}"

    def kept(self) -> str:
        """This run's newest checkpoint and the command that continues from it."""
        from orlhf.storage.checkpoint import read_meta

        newest = self._newest()
        if newest is None:
            return "no checkpoint kept: run the same command to start again from the beginning"
        controller = self.attempt.controller if self.attempt is not None else None
        trained, saved = (controller.step_index if controller is not None else 0), int(read_meta(newest)["step"])
        if trained == saved:
            return f"checkpoint {newest} kept; run the same command with --load_checkpoint to continue from it"
        after = " (the steps after it are trained again)" if trained > saved else ""
        return (
            f"the newest checkpoint is {newest}; run the same command with --load_checkpoint to continue from it{after}"
        )

    def _newest(self):
        """This run's newest complete checkpoint (never another run's in the same folder), or None."""
        mgr = self.checkpoints
        if mgr is None:
            return None
        from orlhf.storage.checkpoint import read_meta

        return next((p for p in mgr.complete() if read_meta(p).get("run_id") == mgr.run_id), None)
