"""The step loop: schedule -> draft -> verify -> commit -> stream, for every running generation at once.

One task runs it. Each step, the scheduler (gateway/scheduler.py) plans which sequences decode and which prompt
chunks join; the step goes to the verifier as one call (gateway/backends.py), which asks the drafter for its trees
and verifies them with the AR steps in one forward, and runs the chunks; each sequence's outcome is committed, cut
at its stops, and handed to its reader as a Round. Sequences are passive state (gateway/sequence.py): a request
submits one and reads its rounds. A prompt's first chunk starts its verifier session (its drafter session started
first, where it speculates), its last chunk's answer is its first token, and it decodes from the next step on.

A drafter's failure never fails a sequence: it goes on with AR steps, its output the same. A verifier call that runs
short of KV memory (protos.types.MemoryShort) preempts the sequence where it can go on from its output (Engine._preempt); any other
failure ends the sequence with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from gateway.backends import DrafterClient, VerifierClient
from gateway.scheduler import PromptPart, Scheduler, StepPlan
from gateway.sequence import Phase, Round, Sequence, Speculation
from protos.types import MemoryShort, PromptChunk, SamplingParams, SessionStart, SessionStep, StepOutcome, StepResult
from runtime.timing import DeferredTimings

log = logging.getLogger("ddtree.engine")

MAX_STEPS_OUT = 2  # steps launched and not committed at once: the one on the device and the one behind it


class Engine:
    def __init__(
        self, verifier: VerifierClient, drafter: DrafterClient | None, max_step_tokens: int = 0,
        on_fallback: Callable[[BaseException], None] | None = None,
        on_step: Callable[[str, int], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        """max_step_tokens: the prompt tokens a step carries at most (0: any); a longer prompt runs in chunks over
        several steps. on_fallback: told of a drafter failure (metrics, logs). on_step: (rpc, calls) of each batch
        call (metrics). on_resume: told of each preemption's restart."""
        self.verifier = verifier
        self.drafter = drafter
        self.on_fallback = on_fallback
        self.on_step = on_step
        self.on_resume = on_resume
        self.scheduler = Scheduler(max_step_tokens)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tasks: dict[Sequence, asyncio.Task] = {}  # each sequence's opening in flight (Engine._open)
        self._ending: set[asyncio.Task] = set()  # sessions being ended
        self._calls: list[tuple[list[Sequence], asyncio.Future]] = []  # the batch calls out, and for whom

    # ---- the loop ------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Ends the loop and every sequence (their sessions end too)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in self.scheduler.all():
            self._end(seq, asyncio.CancelledError())
        await asyncio.gather(*self._tasks.values(), *self._ending, return_exceptions=True)

    async def _run(self) -> None:
        steps: deque[tuple[StepPlan, asyncio.Task]] = deque()  # launched and not committed, oldest first
        while True:
            for seq in self.scheduler.admit():
                self._open(seq)
            if not steps:
                plan = self.scheduler.plan()
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                steps.append((plan, self._launch(plan)))
            if len(steps) < MAX_STEPS_OUT and (behind := self._behind()) is not None:
                steps.append((behind, self._launch(behind)))
            plan, task = steps.popleft()
            try:
                self._settle(plan, *await task)
            except Exception as exc:  # a step's own bug fails its sequences, never the loop
                log.error("a step failed", exc_info=exc)
                for seq in plan.sequences + [part.seq for part in plan.prompts]:
                    self._end(seq, exc)

    def _behind(self) -> StepPlan | None:
        """The next step, where it may go before the one in flight is answered: to a remote verifier, which reads
        it while it runs the one before and answers in order (verify_server/step.py): it launches an AR step behind
        that one on the device, and drafts a step's trees as soon as that one has ended. It takes the sequences with
        room past what their steps in flight may commit, and one with a grammar only with none in flight (the
        verifier masks its step from its committed tokens): such a sequence steps every other step, and the others'
        go on back to back. So the services go from step to step while the host reads, detokenises and streams the
        last one. A stop token wastes the step after it: the sequence ends there anyway."""
        if not self.verifier.remote:
            return None
        plan = self.scheduler.plan()
        if plan is None:
            return None
        sequences = [seq for seq in plan.sequences
                     if seq.room - seq.ahead * self._most(seq) >= 1 and not (seq.params.grammar and seq.ahead)]
        if not (sequences or plan.prompts):
            return None
        return StepPlan(sequences, plan.prompts)

    def _most(self, seq: Sequence) -> int:
        """The most tokens one step of the sequence commits (one where it does not draft)."""
        return seq.spec.most_tokens(self.drafter.block_size) if seq.drafting else 1

    def _launch(self, plan: StepPlan) -> asyncio.Task:
        for seq in plan.sequences:
            seq.ahead += 1
        for part in plan.prompts:
            part.seq.ahead += 1
            part.seq.prefilled = part.end
        return asyncio.get_running_loop().create_task(self._step(plan))

    async def generate(
        self, prompt: list[int], params: SamplingParams, spec: Speculation, max_tokens: int, stop_ids: Iterable[int],
    ) -> AsyncIterator[Round]:
        """A sequence's rounds, one per step it takes part in (the first: its prompt's); its sessions end however
        the iteration ends (a normal end waits for that, and raises the verifier's failure to end its session). A
        request with min_tokens has its stop tokens held back until then."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not prompt:  # (its chunk would be a step's part of no token)
            raise ValueError("the prompt holds no token")
        if spec.mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {spec.mode!r} needs a drafter")
        seq = Sequence.of(prompt, params, spec, max_tokens, stop_ids)
        self.submit(seq)
        finished = False
        try:
            while not finished:
                item = await seq.rounds.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self.cancel(seq)
        failure = await asyncio.shield(seq.ended)
        if failure is not None:
            raise failure

    def submit(self, seq: Sequence) -> None:
        """A new sequence: it starts at the next turn of the loop."""
        self.scheduler.add(seq)
        self._wake.set()
        self.start()

    def cancel(self, seq: Sequence, error: BaseException | None = None) -> None:
        """Its reader has gone (or ends it with `error`, which the reader gets): it leaves the steps, and its sessions
        end."""
        if seq.phase is not Phase.DONE:
            self._end(seq, error)

    async def _step(self, plan: StepPlan) -> tuple[list[Sequence], list[PromptPart], list, float, float]:
        """One step of the plan's sequences and prompt chunks, in one call to the verifier -> the sequences that
        decoded and the chunks that ran (those of sequences not ended meanwhile), their outcomes in that order, and
        when the step began and was answered."""
        start = time.perf_counter()
        live = [seq for seq in plan.sequences if seq.phase is Phase.RUNNING]  # (some ended meanwhile)
        prompts = [part for part in plan.prompts if part.seq.phase is Phase.PREFILLING]
        steps = []
        for seq in live:
            untap, seq.untap = seq.untap, False
            if seq.drafting:
                budget, top_k = seq.spec.tree_shape(self.drafter.block_size)
                steps.append(SessionStep(seq.id, budget, top_k))
            else:
                steps.append(SessionStep(seq.id, 0, None, untap))
        steps += [SessionStep(part.seq.id, prompt=self._chunk(part)) for part in prompts]
        seqs = live + [part.seq for part in prompts]
        outcomes = await self._call("Step", self.verifier.step, steps, seqs) if steps else []
        return live, prompts, outcomes, start, time.perf_counter()

    def _chunk(self, part: PromptPart) -> PromptChunk:
        """A prompt chunk as the verifier takes it; the first starts the sequence's verifier session (whose end the
        engine sends however the chunk goes)."""
        seq, start = part.seq, None
        if part.begin == 0:
            block = self.drafter.block_size if seq.drafting else 1
            capacity = len(seq.prompt) + seq.max_tokens + seq.spec.max_nodes(block) + 1
            taps = self.drafter.target_layer_ids if seq.drafting else ()
            start, seq.verifying = SessionStart(capacity, seq.params, tuple(taps)), True
        return PromptChunk(seq.prompt[part.begin : part.end], not part.last, seq.reused, start)

    def _settle(self, plan: StepPlan, live: list[Sequence], prompts: list[PromptPart], outcomes: list, start: float,
                done: float) -> None:
        """A step's outcomes, each committed to its sequence (those done meanwhile are passed over)."""
        for seq in plan.sequences:
            seq.ahead -= 1
        for part in plan.prompts:
            part.seq.ahead -= 1
        for part, outcome in zip(prompts, outcomes[len(live):]):
            self._prompted(part, outcome)
        for seq, outcome in zip(live, outcomes):
            if seq.phase is not Phase.RUNNING:
                continue  # cancelled, finished or preempted meanwhile
            if isinstance(outcome, BaseException):
                self._failed(seq, outcome)
                continue
            if outcome.draft_error is not None:  # it took an AR step instead, untapped
                self._fall_back(seq, outcome.draft_error, untapped=True)
            if isinstance(outcome.step, BaseException):
                self._failed(seq, outcome.step)
                continue
            self._commit(seq, outcome.step, outcome.tree_size, round_timings(outcome, done - start))

    async def _call(self, rpc: str, call: Callable, asks: list, seqs: list[Sequence]) -> list:
        """A step's batch call for `seqs` -> each ask's outcome; a failure of the whole call is each ask's. Once
        every one of `seqs` is done (their readers gone) the call is cancelled: nobody waits for it."""
        if self.on_step is not None:
            self.on_step(rpc, len(asks))
        task = asyncio.ensure_future(call(asks))
        entry = (seqs, task)
        self._calls.append(entry)
        try:
            outcomes = await task
            if len(outcomes) != len(asks):
                raise RuntimeError(f"{rpc}: {len(outcomes)} outcomes for {len(asks)} calls")
            return outcomes
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the loop itself stops
            return [asyncio.CancelledError()] * len(asks)
        except Exception as exc:  # noqa: BLE001 - each ask fails with it
            return [exc] * len(asks)
        finally:
            self._calls.remove(entry)

    def _commit(self, seq: Sequence, step: StepResult, tree_size: int, timings: Mapping[str, float]) -> None:
        """A step's outcome: its tokens cut at the sequence's stops, handed to the reader; the end where it
        finished."""
        tokens, logprobs, finish = seq.take(step)
        seq.hand(Round(seq.index, tokens, tree_size, finish, timings, logprobs))
        if finish is not None:
            self._end(seq, None)

    # ---- a sequence's start: sessions and prompt -----------------------------------------------------------

    def _open(self, seq: Sequence) -> None:
        """A sequence starts: its prompt's chunks may go once its drafter session has started, where it speculates
        (in a task: the drafter's prefix cache says which prompt positions it restored), and a restart's last
        sessions have ended (their memory first)."""
        seq.began = time.perf_counter()
        if seq.prior is None and (self.drafter is None or seq.spec.mode == "ar"):
            seq.opened = True
        else:
            self._tasks[seq] = asyncio.get_running_loop().create_task(self._start_drafter(seq))

    async def _start_drafter(self, seq: Sequence) -> None:
        try:
            if seq.prior is not None:
                prior, seq.prior = seq.prior, None
                await asyncio.shield(prior)
            if self.drafter is not None and seq.spec.mode != "ar":
                try:
                    seq.reused = await self.drafter.start_session(
                        seq.id, len(seq.prompt) + seq.max_tokens, seq.params.grammar, seq.prompt)
                    seq.drafting = True
                except Exception as exc:  # noqa: BLE001 - any drafter failure degrades to AR
                    self._notify_fallback(exc)
        finally:
            self._tasks.pop(seq, None)
        if seq.phase is Phase.PREFILLING:  # (not cancelled meanwhile)
            seq.opened = True
            self._wake.set()

    def _prompted(self, part: PromptPart, outcome: StepOutcome | BaseException) -> None:
        """A prompt chunk's outcome: the prompt's first token where it was the last, handed to the reader as the
        first round; the sequence decodes from the next step on."""
        seq = part.seq
        if seq.phase is not Phase.PREFILLING:
            return  # cancelled meanwhile
        step = outcome if isinstance(outcome, BaseException) else outcome.step
        if isinstance(step, BaseException):
            self._failed(seq, step)
            return
        seq.prompt_s += step.forward_s
        if not part.last:
            return
        tokens, logprobs, finish = seq.take(step)
        timings = {"verify_s": seq.prompt_s, "round_s": time.perf_counter() - seq.began}
        seq.hand(Round(seq.index, tokens, 0, finish, timings, logprobs))
        if finish is not None:
            self._end(seq, None)
        else:
            self.scheduler.run(seq)

    # ---- a sequence's end ----------------------------------------------------------------------------------

    def _failed(self, seq: Sequence, exc: BaseException) -> None:
        """A verifier call failed for the sequence: preempted where it ran short of memory and can go on from its
        output, else it ends with the failure."""
        if isinstance(exc, MemoryShort) and self.scheduler.preemptible(seq):
            self._preempt(seq)
        else:
            self._end(seq, exc)

    def _preempt(self, seq: Sequence) -> None:
        """vLLM's recompute preemption: the sequence's sessions end (their memory frees), and it waits to start
        again from its prompt and its output so far (the prefix caches hold most of them), its rounds going on
        where they stopped (Sequence.restart)."""
        seq.prior = self._end_sessions(seq, final=False)
        self.scheduler.preempt(seq)
        if self.on_resume is not None:
            self.on_resume()
        self._wake.set()

    def _end(self, seq: Sequence, exc: BaseException | None) -> None:
        """The sequence is done: finished (exc None, its last round handed), failed (its reader gets `exc`) or
        cancelled; it leaves the scheduler and its sessions end."""
        if seq.phase is Phase.DONE:
            return
        task = self._tasks.pop(seq, None)
        if task is not None:
            task.cancel()
        self.scheduler.remove(seq)
        seq.phase = Phase.DONE
        for seqs, call in self._calls:
            if all(s.phase is Phase.DONE for s in seqs):
                call.cancel()  # its step's call serves nobody any more
        if exc is not None:
            seq.rounds.put_nowait(exc)
        self._end_sessions(seq, final=True)
        self.scheduler.freed()  # a preempted sequence may go on
        self._wake.set()

    def _end_sessions(self, seq: Sequence, final: bool) -> asyncio.Task:
        """Ends its sessions on both services, in a task of its own that outlives the reader; final: `seq.ended`
        resolves once they have ended."""
        ends, verified = [], seq.verifying
        if seq.verifying:
            seq.verifying = False
            ends.append(self.verifier.end_session(seq.id))
        if seq.drafting:
            seq.drafting = False
            ends.append(self.drafter.end_session(seq.id))
        task = asyncio.get_running_loop().create_task(_gathered(ends, seq if final else None, verified))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)
        return task

    def _fall_back(self, seq: Sequence, exc: BaseException, untapped: bool = False) -> None:
        """The drafter failed for the sequence (down, timed out, erroring): it goes on with AR steps, its output
        unchanged; its next step untaps its verifier session (untapped: the verifier has done so)."""
        self._notify_fallback(exc)
        seq.untap = not untapped
        if seq.drafting:
            seq.drafting = False
            task = asyncio.get_running_loop().create_task(_quietly(self.drafter.end_session(seq.id)))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    def _notify_fallback(self, exc: BaseException) -> None:
        if self.on_fallback is not None:
            self.on_fallback(exc)


async def _gathered(ends: list, seq: Sequence | None, verified: bool) -> None:
    """Awaits the session ends (the verifier's first); `seq.ended` (where given) resolves with the verifier's
    failure, or None (a dead drafter's sessions die with it, or expire by TTL; the verifier's must not leak)."""
    results = await asyncio.gather(*ends, return_exceptions=True)
    if seq is not None and not seq.ended.done():
        seq.ended.set_result(results[0] if verified and isinstance(results[0], Exception) else None)


async def _quietly(call) -> None:
    with contextlib.suppress(Exception):  # a dead drafter's sessions die with it (or expire by TTL)
        await call


def round_timings(outcome: StepOutcome, round_s: float) -> Mapping[str, float]:
    """A round's timings: its draft's (in-process, read lazily: they wait for the device), its verify's."""
    draft, verify, verify_s = outcome.draft_timings, outcome.step.timings, outcome.step.forward_s
    return DeferredTimings(lambda: {**draft, **verify, "verify_s": verify_s, "round_s": round_s})


