"""Backend health: what the gateway knows about the verifier and the drafter, kept current by a background check.

The drafter is optional to correctness (the round loop decodes autoregressively without it), so a drafter that
fails or reports not-SERVING is skipped by new requests until a check finds it serving again. A backend that comes
back (restarted, by `ddtree serve` or an orchestrator) is asked for its Info again, since its limits and its round
lane's port may have changed, and taken back: the gateway itself never needs a restart. While a backend is down
(or loading) it is looked for every LOADING_INTERVAL_S at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from protos.types import DrafterInfo, VerifierInfo
from gateway.metrics import Metrics
from gateway.backends import DrafterClient, VerifierClient
from gateway.fit import info_misfit
from runtime.client import BackendError

log = logging.getLogger("ddtree.gateway")
T = TypeVar("T")
LOADING_INTERVAL_S = 0.5  # while the verifier is down every request gets 503, so it is looked for often


class VerifierBackend(VerifierClient, Protocol):
    async def info(self) -> VerifierInfo: ...

    async def health(self) -> bool: ...  # True when the service reports SERVING


class DrafterBackend(DrafterClient, Protocol):
    async def info(self) -> DrafterInfo: ...  # a remote drafter also learns its block size and taps here

    async def health(self) -> bool: ...


@dataclass
class Backends:
    verifier: VerifierBackend
    drafter: DrafterBackend | None  # None: autoregressive only


class BackendMonitor:
    def __init__(self, backends: Backends, interval: float, metrics: Metrics) -> None:
        self.backends = backends
        self.interval = interval  # between checks, and the time limit of one health/info call
        self.metrics = metrics
        self.verifier_info: VerifierInfo | None = None  # None until the verifier first answered: loading
        self.drafter_info: DrafterInfo | None = None  # the drafter is not used before it answered
        self.drafter_misfit: str | None = None  # why the drafter cannot draft for the target, if it cannot
        self.verifier_up = False
        self.drafter_up = False
        self._recheck = asyncio.Event()  # set to check now rather than at the next interval
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def recheck(self) -> None:
        self._recheck.set()

    def drafter_failed(self, exc: BaseException) -> None:
        """The round loop's on_fallback: the request carries on autoregressively, new ones skip the drafter; but
        where the drafter only holds no more sessions (RESOURCE_EXHAUSTED: its slots are all held, as its reserved
        memory sizes them), it is up and the next requests try it again."""
        self.metrics.fallbacks.inc()
        if isinstance(exc, BackendError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.info("the drafter holds no more sessions (%s): the request decodes autoregressively", exc.details)
            return
        log.warning("drafter call failed (%s): the request continues autoregressively", exc)
        self._set_drafter_up(False)
        self.recheck()

    async def _watch(self) -> None:
        while True:
            self._recheck.clear()
            await self.check()
            all_up = self.verifier_up and (self.backends.drafter is None or self.drafter_up)
            interval = self.interval if all_up else min(self.interval, LOADING_INTERVAL_S)
            # asyncio.timeout rather than wait_for: on Python 3.11 wait_for can swallow the cancellation of stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._recheck.wait()

    async def check(self) -> None:
        verifier, drafter = self.backends.verifier, self.backends.drafter
        up = await self._ask(verifier.health) is True
        if up and not self.verifier_up:  # first seen, or back: its Info now (None: not yet)
            info = await self._ask(verifier.info)
            up = info is not None
            if up:
                self._count_recovery("verifier", self.verifier_info is not None)
                self.verifier_info = info
                log.info("verifier serving %s", info.model_name)
        if self.verifier_up and not up:
            log.warning("verifier is down: requests get 503 until it serves again")
        self.verifier_up = up
        self.metrics.backend_up.labels("verifier").set(up)
        if drafter is not None:
            up = await self._ask(drafter.health) is True
            if up and not self.drafter_up:
                info = await self._ask(drafter.info)
                up = info is not None and self._fits(info)
                if up:
                    self._count_recovery("drafter", self.drafter_info is not None)
                    self.drafter_info = info
            self._set_drafter_up(up)

    def _fits(self, info: DrafterInfo) -> bool:
        """Whether the drafter fits the verifier's target (not known before the verifier's Info: not yet). A misfit
        is logged once and /health reports it; requests decode autoregressively."""
        if self.verifier_info is None:
            return False
        misfit = info_misfit(self.verifier_info, info)
        if misfit is not None and misfit != self.drafter_misfit:
            log.error("the drafter does not fit the verifier's target, so it is not used: %s", misfit)
        self.drafter_misfit = misfit
        return misfit is None

    def _count_recovery(self, service: str, known: bool) -> None:
        """A backend serving again after it was marked down (`known`: it had served before)."""
        if known:
            log.info("%s is back", service)
            self.metrics.recoveries.labels(service).inc()

    def _set_drafter_up(self, up: bool) -> None:
        if up != self.drafter_up:
            log.log(logging.INFO if up else logging.WARNING, "drafter is %s",
                    "up: speculating" if up else "down: decoding autoregressively")
        self.drafter_up = up
        self.metrics.backend_up.labels("drafter").set(up)

    async def _ask(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """One bounded health/info call; None when it fails (unreachable, timed out, erroring: all mean "not now")."""
        try:
            async with asyncio.timeout(self.interval):
                return await call()
        except Exception as exc:  # noqa: BLE001 - the next check asks again
            log.debug("backend call failed: %s", exc)
            return None

    def status(self) -> tuple[int, dict[str, str]]:
        """(HTTP status, body) for /health. 200 "ok": both backends serving (or no drafter configured). 200
        "degraded": the drafter is down and requests are decoded autoregressively: slower, same output, so load
        balancers should keep sending traffic. 503 "loading" until the verifier first answered, 503 "unavailable"
        while it is down."""
        drafter = "disabled" if self.backends.drafter is None else "up" if self.drafter_up else "down"
        body = {"verifier": "up" if self.verifier_up else "down", "drafter": drafter}
        if self.verifier_info is None:
            return 503, {"status": "loading", "reason": "waiting for the verifier to serve", **body}
        if not self.verifier_up:
            return 503, {"status": "unavailable", "reason": "the verifier is not serving", **body}
        if drafter == "down" and self.drafter_misfit is not None:
            return 200, {"status": "degraded", **body, "drafter": "unfit",
                         "reason": f"the drafter does not fit the target ({self.drafter_misfit}): decoding "
                                   "autoregressively"}
        if drafter == "down":
            return 200, {"status": "degraded", "reason": "the drafter is down: decoding autoregressively", **body}
        return 200, {"status": "ok", **body}
