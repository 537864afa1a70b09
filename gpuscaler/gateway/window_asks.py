"""The windows a gateway asks its agents for: KEDA's until they go idle, a read's one-shot ones while it reads."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import NoReturn

import structlog

from gpuscaler.model.errors import Unavailable, Unsupported
from gpuscaler.model.windows import MAX_WINDOWS, READ_WINDOWS_RESERVE, WindowKey
from gpuscaler.server.overload import LogEvery

log = structlog.get_logger(__name__)

# A window no query used for this long is no longer asked for (KEDA asks each query every 30 s at least).
WINDOW_IDLE_SECONDS = 15 * 60.0
# Idle windows are looked for at most this often (a pass over at most MAX_WINDOWS): one leaves within this long
# after it went idle, and the agents stop computing it then, not when the list next changes.
WINDOW_SWEEP_SECONDS = 10.0


class WindowAsks:
    """Which windows every agent is asked for (``windows``, read by each subscriber when it opens its stream), and
    ``changed``, set (and replaced) whenever they change, which reopens every agent's stream.

    KEDA's calls ``request`` a window, which stays asked for until WINDOW_IDLE_SECONDS after its last request
    (``forget_idle``, which the view calls on each composition, lets it go within WINDOW_SWEEP_SECONDS of that). A
    read ``hold``s the windows no KEDA call uses, and ``let_go`` stops asking for those no other read holds; a
    read neither adds to KEDA's nor moves their last use. Since each change reopens thousands of streams, only the
    read holding the one ``turn`` may add one-shot windows, and it lets them go before it gives the turn back.

    KEDA's windows count against MAX_WINDOWS, reads' one-shot ones only against READ_WINDOWS_RESERVE on top of
    them, so that a read never costs a KEDA call its window, and the agents are never asked for more than
    MAX_WINDOWS + READ_WINDOWS_RESERVE, which they serve.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._keda: dict[WindowKey, float] = {}  # KEDA's windows, with when each was last used
        self._reading: dict[WindowKey, int] = {}  # windows reads in flight hold, by how many (KEDA's too, once)
        self._turn = asyncio.Lock()
        self.refused = 0  # reads refused because another read held the turn past their deadline
        self._refused_log = LogEvery("read_window_refused", level="warning")
        self._next_sweep = -math.inf
        self.changed = asyncio.Event()

    @property
    def windows(self) -> tuple[WindowKey, ...]:
        """The windows the agents are asked for: KEDA's, then the one-shot ones of reads in flight."""
        return (*self._keda, *(window for window in self._reading if window not in self._keda))

    @property
    def one_shot(self) -> int:
        """How many of ``windows`` only reads in flight ask for."""
        return sum(1 for window in self._reading if window not in self._keda)

    def asked(self, window: WindowKey) -> bool:
        """Whether the agents are asked for ``window`` now (by KEDA's calls or a read in flight)."""
        return window in self._keda or window in self._reading

    def request(self, windows: Iterable[WindowKey]) -> None:
        """KEDA's calls use ``windows`` now: asked for from now on (a read's one-shot window becomes KEDA's without
        a new ask), each until WINDOW_IDLE_SECONDS after its last request. Unsupported past MAX_WINDOWS of KEDA's
        at once; reads' one-shot windows do not count."""
        now = self._clock()
        wanted = list(dict.fromkeys(windows))
        # All of a combined query's windows are asked for, or none: one left out would never reach the agents.
        mine = [window for window in wanted if window not in self._keda]
        gone = self._make_room(mine, now) if mine else False
        added = [window for window in mine if window not in self._reading]
        for window in wanted:
            self._keda[window] = now
        if gone and not added:
            self._changed()
        if added:
            self._changed()
            log.info("window_requested", windows=[w.describe() for w in added], total=len(self._keda))

    def hold(self, windows: Sequence[WindowKey]) -> list[WindowKey]:
        """Count a read in on each of ``windows`` KEDA's calls do not use, asking for the new ones (only with the
        ``turn``); those it holds, for ``let_go``. KEDA's windows are read as they are. Unavailable, holding
        nothing, if the new ones would take the one-shot windows past READ_WINDOWS_RESERVE (KEDA's room is not
        the reads' to take)."""
        mine = [window for window in windows if window not in self._keda]
        new = [window for window in mine if window not in self._reading]
        if new and self.one_shot + len(new) > READ_WINDOWS_RESERVE:
            self._refuse(
                f"reads in flight hold {self.one_shot} of the {READ_WINDOWS_RESERVE} one-shot windows a gateway asks "
                f"its agents for on top of KEDA's {MAX_WINDOWS}, and this read needs {len(new)} more",
                f"{new[-1].describe()} is not one KEDA's calls use, and reads in flight hold {self.one_shot} of the "
                f"{READ_WINDOWS_RESERVE} one-shot windows the gateway may ask its agents for besides KEDA's "
                f"{MAX_WINDOWS}; ask again in a moment, or let a ScaledObject use the window",
            )
        for window in mine:
            self._reading[window] = self._reading.get(window, 0) + 1
        if new:
            self._changed()
            log.info("window_read_once", windows=[w.describe() for w in new], total=len(self.windows))
        return mine

    def let_go(self, windows: Sequence[WindowKey]) -> None:
        """Count a read out of ``windows``; stop asking for those no read holds and KEDA's calls do not use."""
        dropped = []
        for window in windows:
            count = self._reading.pop(window) - 1
            if count:
                self._reading[window] = count
            elif window not in self._keda:
                dropped.append(window)
        if dropped:
            self._changed()
            log.info("window_read_done", windows=[w.describe() for w in dropped], total=len(self.windows))

    @contextlib.asynccontextmanager
    async def turn(self, deadline: float) -> AsyncIterator[None]:
        """The one turn to add one-shot windows, waited for until ``deadline`` (the loop's clock); past it,
        Unavailable, counted in ``refused`` and logged at most once per interval."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._turn.acquire()
        except TimeoutError:
            self._refuse(
                "another read's one-shot window ask held the turn past this read's deadline",
                "the window is not one KEDA's calls use, and another read's one-shot window ask held the gateway's "
                "one turn (each change reopens every agent's stream) past this read's deadline; ask again in a "
                "moment, or let a ScaledObject use the window",
            )
        try:
            yield
        finally:
            self._turn.release()

    def forget_idle(self) -> None:
        """Let KEDA's windows idle past WINDOW_IDLE_SECONDS go, looking at most every WINDOW_SWEEP_SECONDS (the
        view calls this on each composition); if the agents are asked for fewer, ``changed`` reopens their streams
        with the rest. A window a read in flight holds stays asked for until that read lets it go."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + WINDOW_SWEEP_SECONDS
        gone = [window for window in self._drop_idle(now) if window not in self._reading]
        if gone:
            self._changed()
            log.info("window_idle", windows=[w.describe() for w in gone], total=len(self.windows))

    def _drop_idle(self, now: float) -> list[WindowKey]:
        """Forget KEDA's windows idle past WINDOW_IDLE_SECONDS at ``now``; those forgotten."""
        idle = [window for window, used in self._keda.items() if now - used > WINDOW_IDLE_SECONDS]
        for window in idle:
            del self._keda[window]
        return idle

    def _refuse(self, detail: str, message: str) -> NoReturn:
        """A read refused: counted in ``refused``, logged at most once per interval, Unavailable with ``message``."""
        self.refused += 1
        self._refused_log(detail=detail)
        raise Unavailable(message)

    def _make_room(self, new: Sequence[WindowKey], now: float) -> bool:
        """Let KEDA's idle windows go; Unsupported if ``new`` (not KEDA's yet) would still take KEDA's windows past
        MAX_WINDOWS. Whether any the agents were asked for went: the caller reopens their streams, and a refusal
        does so here."""
        gone = [window for window in self._drop_idle(now) if window not in self._reading]
        if gone:
            log.info("window_idle", windows=[w.describe() for w in gone], total=len(self.windows))
        if len(self._keda) + len(new) > MAX_WINDOWS:
            if gone:
                self._changed()
            raise Unsupported(
                f"{new[-1].describe()} would be one window too many: the gateway asks its agents for at most "
                f"{MAX_WINDOWS} distinct windows for KEDA's calls (each costs every agent a pass over its history "
                f"per tick), and {len(self._keda)} are in use; use fewer distinct window lengths and functions"
            )
        return bool(gone)

    def _changed(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
