"""A front process's own refusals while its engine process refuses: client-side adaptive throttling, as the Google
SRE book describes it ("Handling Overload").

Under overload most requests are refused, and a refusal made by the engine process costs its core what an answer
would have had (docs/design/serving.md, "Refusals cost as little as the protocol can make them"). So each front
keeps, per engine and kind of call, the requests it has an outcome for (refused here, or answered by the engine) and
those the engine accepted (did not refuse as overloaded) over the last few seconds, and refuses a new call itself
with probability max(0, (requests - K * accepted) / (requests + 1)): while the engine accepts everything, nothing;
while it accepts only some, about K times what it accepts goes on (K > 1 leaves the engine room to show it can take
more: what goes on then grows by about K per TAU_S) and the rest is refused by the front, on its own core. Counts
decay exponentially (time constant TAU_S), so a front idle for a while starts afresh. The engine counts the front's
refusals in its metrics (reason "throttled"), told with the front's next request to it.

K is per work class, from the slots the engine gives it (send_ratio). Once settled, the engine refuses 1 - 1/K of
what it is sent, and a class with few slots and a short queue refuses that share while still below its capacity
(calls bunch), so the fewer its slots, the larger the K that keeps it busy (K - 1 falls with the square root of the
slots, as in square-root staffing). Why, and what was measured: docs/design/serving.md ("Refusals made where the
answering core does not pay").
"""

from __future__ import annotations

import math
import random
from time import monotonic
from typing import Callable

MIN_K = 1.5  # the fewest calls sent on per call the engine accepts (the book's 2: it refuses as many as it answers)
TAU_S = 1.0  # the counts' time constant: the throttle follows the engine within a few seconds


def send_ratio(slots: int) -> float:
    """K for a work class the engine runs `slots` requests of at once, at least (its floor: see the docstring)."""
    return max(MIN_K, 1.0 + 2.5 / math.sqrt(max(1, slots)))


class Throttle:
    """One engine's acceptance of one kind of call, seen from a front (see the module's docstring)."""

    __slots__ = ("k", "requests", "accepted", "_at", "_clock", "_draw")

    def __init__(self, k: float = MIN_K, clock: Callable[[], float] = monotonic,
                 draw: Callable[[], float] = random.random) -> None:
        self.k = k  # calls sent on per call the engine accepts
        self.requests = 0.0  # calls refused here or answered by the engine ...
        self.accepted = 0.0  # ... and those the engine accepted
        self._clock, self._draw = clock, draw
        self._at = clock()

    def share(self) -> float:
        """The share of new calls refused by the front now."""
        self._decay()
        return max(0.0, (self.requests - self.k * self.accepted) / (self.requests + 1.0))

    def refusing(self) -> bool:
        """Whether any share is refused now: decay scales both counts alike, so this needs none."""
        return self.requests > self.k * self.accepted

    def refuse(self) -> bool:
        """Whether the call arriving now is refused here. A refused call counts as a request now; one sent on counts
        once the engine answers it (answered): counted while in flight, a burst of calls sent together would look
        unaccepted and the front would refuse the burst's tail. A call the engine never answers (it is gone) never
        counts, or the front would go on refusing for its own sake once the engine is back."""
        share = self.share()
        if share and self._draw() < share:
            self.requests += 1.0
            return True
        return False

    def answered(self, accepted: bool) -> None:
        """The engine's answer to a call sent: accepted, or refused as overloaded."""
        self._decay()
        self.requests += 1.0
        if accepted:
            self.accepted += 1.0

    def _decay(self) -> None:
        now = self._clock()
        if now > self._at:
            keep = math.exp((self._at - now) / TAU_S)
            self.requests *= keep
            self.accepted *= keep
            self._at = now
