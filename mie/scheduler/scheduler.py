"""The continuous-batching scheduler: admit, decode and preempt sequences over a paged pool.

The contract with the model runner (the engine codes against exactly this)::

    seq = sched.submit(prompt_token_ids, max_tokens, stop_token_ids)  # RequestTooLongError?
    while sched.has_unfinished():
        batch = sched.step()  # decode -> prompt chunks -> admit: allocation, CoW, preemption
        next_tokens = runner(batch)  # one token id per *sampling* entry, same order
        finished = sched.commit(batch, next_tokens)  # append, stop, reap, prefix cache

* Each ``BatchEntry`` asks for tokens ``seq.token_ids[start : start + num_tokens]`` at those
  positions. Their slots are already in ``seq.table``, and every block they fall in already
  has refcount 1: the scheduler did copy-on-write while scheduling, where it can still preempt
  on a failed allocation. The runner writes K/V and never allocates.
* The runner answers one next token per entry that *samples* (``entry.samples``: its tokens
  reach the end of the sequence), in order. A decode entry samples; a prefill entry samples
  when it completes the prompt (or, after a preemption, all the tokens it recomputes) and
  answers the token after it. A chunk that ends inside the prompt produces no token: the
  runner computes its K/V and skips the sampler (and the LM head).
* ``commit`` marks the entries' tokens computed, registers newly full blocks in the prefix
  cache (only now is their KV real), appends the tokens, applies the stop conditions and
  *reaps*: finished sequences leave ``running`` and release their blocks at once -- a drained
  scheduler holds no block (the prefix cache's idle blocks aside). It returns them.
* ``step()`` raises while a batch is uncommitted. ``abort`` may come between ``step`` and
  ``commit``; ``commit`` then ignores that entry.

**Speculative decoding.** ``step(proposals)`` takes, per sequence id, tokens proposed to follow
a decoding sequence's newest token (an n-gram lookup, a draft model: the engine's business).
Its decode entry then computes the newest token *and* the proposals (``entry.spec_token_ids``,
its last tokens), so the runner has the logits of every one of them in the same forward pass,
and answers a *list*: the proposals it accepted, in order, then its own next token (1 to
``len(spec_token_ids) + 1`` tokens). ``commit`` keeps the KV of the accepted ones and cuts the
rejected ones' slots off the table (``BlockTable.truncate``: the blocks left without a token go
back to the pool at once). Proposals are trimmed to what the step allows: never past the
request's ``max_tokens``, within the token budget left after one token for every decode, and
only where the memory is there -- a sequence whose proposals find no block decodes without
them, and nobody is preempted to make room for a guess. A block holding a rejected token's KV
is never registered in the prefix cache or lent: both only ever see computed tokens
(``num_computed``), and a slot past it is written again before it becomes one.

Every step has a token budget, ``max_num_batched_tokens``. Two ways to spend it:

* ``enable_chunked_prefill=True`` (vLLM v1's rule; what the engine uses by default): a
  prompt is computed in chunks of whatever budget is left, so a long prompt never stops the
  sequences already decoding for more than one budget's worth of compute.
* ``False`` (the seed's rule, and this class's default): a prompt is computed whole, in the
  step that admits it, and waits until the budget has room for all of it.

A step, in order:

1. **decode** -- every running sequence past its prompt gets a slot for its newest token
   (one token of budget each; ``max_num_batched_tokens >= max_num_seqs`` so they always
   fit). When one cannot get a block, victims are preempted LIFO (``running[-1]``, the most
   recently admitted, never the requester): their blocks are dropped, their tokens kept,
   and they go back to the front of ``waiting``; readmission recomputes prompt + generated
   tokens. If no victim is left, the requester itself goes back. ``running + waiting``
   therefore always stays in arrival order (``check_integrity`` verifies it).
2. **prompt chunks** (chunked prefill only) -- every running sequence still inside its
   prompt gets its next chunk, in admission order: ``min(tokens left, budget left)``, and no
   more than the free memory holds (at least one token, preempting LIFO like a decode when
   even that has no block). A chunk may end anywhere, not only on a block boundary.
3. **admit** -- strict FCFS: the front of ``waiting`` is admitted while there is a sequence
   slot, token budget and memory, and admission stops at the first request that doesn't
   fit; no request is skipped. Whole: it needs budget and memory for its whole prompt.
   Chunked: it takes ``min(its prompt, budget left)`` tokens, as much as memory holds, and
   carries on with step 2 in later steps. The memory is what is left after the blocks the
   running sequences' tokens of this step need, so an admission never makes a running
   sequence preempt in the same step. An admitted sequence first borrows the KV it can (the
   longest computed prefix it shares with a running sequence, or, with ``prefix_caching``,
   the longest cached prefix). A prompt that is cached entirely still computes its last
   token, whose logits are needed: a hit covers at most the first ``num_tokens - 1`` tokens
   (whole blocks only, with the cache, so the last token's block is a fresh one).

``commit`` registers full blocks with the prefix cache as soon as the chunk that fills them
is computed, so a long prompt becomes borrowable chunk by chunk.

**Sliding windows** (``sliding_window=w``, the model's; None: full attention). Once a
sequence has computed ``c`` tokens, its next query is position ``c`` and no query of it will
ever read a position before ``c - w + 1`` again, in any layer. The blocks wholly before that
position go back to the pool (``BlockTable.release_before``) as soon as ``num_computed``
moves -- in ``commit``, and right after borrowing a prefix at admission -- so a decoding
sequence holds at most ``window_blocks(w) = ceil((w - 1) / block_size) + 1`` blocks (its
last ``w`` positions) plus what the step's chunk adds, however long it generates. Admission
counts growth in new blocks (released ones were given back) -- and counts a borrowed prefix
as what the sequence *keeps* of it: an idle cached block it borrows leaves the evictable
reserve, unless it lies wholly before the window, where the release right after borrowing
gives it back, idle and evictable again (``_released_after``). Counting those as taken would
livelock the scheduler: a pool holding nothing but a cached prefix longer than the window
would have "no memory" for the request that wants it, and nothing running to free any.
Three rules keep everything else right:

* a sequence with released blocks lends no prefix to a new one (``borrow_prefix`` needs the
  blocks from position 0); the prefix cache is unaffected: it registers full blocks in
  ``commit`` *before* they are released, holds its own reference, and a released cached block
  simply becomes evictable (an idle prefix a later prompt can borrow whole -- a block's KV
  depends only on the tokens up to it, window or not);
* a preempted sequence drops what it still holds and is recomputed from position 0, releasing
  again as its chunks commit;
* ``check_request_fits``: with chunked prefill a request needs only
  ``min(its blocks, window_blocks(w))`` (one-token chunks always progress); computing prompts
  whole, a recompute still holds the whole context at once, so nothing changes there.

A request that could never run -- its prompt + ``max_tokens`` - 1 tokens need more blocks
than the whole pool, or, computing prompts whole, more tokens than ``max_num_batched_tokens``
(a preempted sequence is recomputed in one prefill) -- is rejected by ``submit`` with
``RequestTooLongError``, so the front of ``waiting`` always fits an otherwise empty
scheduler: no livelock. With chunked prefill the budget limits nothing but the step size.
Should admission ever get that wrong again, no step repeats silently: a step with requests
waiting, nothing running and nothing admitted raises ``SchedulerStallError`` (nothing
changed) instead of returning an empty batch that every later step would repeat.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from mie.checks import check_capacity, is_int, positive_int, token_ids
from mie.scheduler.batch import Batch, BatchEntry
from mie.scheduler.integrity import check_integrity
from mie.scheduler.prefix_cache import PrefixCache, PrefixCursor
from mie.scheduler.sequence import FINISH_ABORT, Sequence
from mie.scheduler.trace import StepTrace


class RequestTooLongError(ValueError):
    """A request whose prompt + max_tokens can never fit this scheduler."""


class SchedulerStallError(RuntimeError):
    """``step()`` found requests waiting, nothing running, and could admit none.

    Nothing running means nothing will ever free memory or change the queue, so every later
    step would be the same empty one: the engine would spin forever while its clients wait.
    ``submit`` refuses every request that could not run on an otherwise empty scheduler, so
    this is a defect of the admission arithmetic, never a matter of load -- but it must
    never pass silently. ``step()`` raises it *before* handing out a batch, with nothing
    changed (no batch pending, the step not counted), so the caller can abort the request
    at the head of ``waiting`` (``seq_id``) and step again; ``LLMEngine.step`` does.

    Both backends raise it, with the same message (``stall_error`` builds it).
    """

    def __init__(
        self, message: str, seq_id: int, num_tokens: int, num_free: int, num_evictable: int
    ) -> None:
        super().__init__(message)
        self.seq_id = seq_id  # the request at the head of ``waiting``
        self.num_tokens = num_tokens  # its tokens (prompt + generated so far)
        self.num_free = num_free  # the pool's free blocks
        self.num_evictable = num_evictable  # idle cached blocks (the prefix cache's)


def stall_error(scheduler) -> SchedulerStallError:
    """The ``SchedulerStallError`` for ``scheduler`` (either backend's) as it stands: naming
    the request at the head of its queue, its size and the memory there was for it."""
    seq = scheduler.waiting[0]
    pool, cache = scheduler.pool, scheduler.prefix_cache
    free, evictable = pool.num_free, cache.num_evictable if cache is not None else 0
    blocks = _blocks_for(seq.num_tokens, scheduler.block_size)
    return SchedulerStallError(
        f"scheduler stalled: nothing is running and the request at the head of the queue "
        f"(seq_id {seq.seq_id}: {seq.num_tokens} tokens, {blocks} blocks of "
        f"{scheduler.block_size}) cannot be admitted with {free} free and {evictable} "
        f"evictable blocks of {pool.num_blocks}; no later step would differ (a scheduler "
        "defect: abort that request to go on)",
        seq.seq_id,
        seq.num_tokens,
        free,
        evictable,
    )


def _checked_proposals(proposals: Mapping[int, Iterable[int]] | None) -> dict[int, tuple]:
    """``step``'s proposals as seq_id -> tuple of token ids; ValueError for anything else."""
    if proposals is None:
        return {}
    if not isinstance(proposals, Mapping):
        raise ValueError(f"proposals must map seq_id to token ids, got {proposals!r}")
    checked = {}
    for seq_id, tokens in proposals.items():
        if not is_int(seq_id):
            raise ValueError(f"proposals' keys must be seq_ids (ints), got {seq_id!r}")
        checked[seq_id] = tuple(token_ids(tokens, f"proposals[{seq_id}]"))
    return checked


def _checked_answers(batch: Batch, next_tokens: Iterable[int]) -> list[tuple[int, ...]]:
    """``commit``'s ``next_tokens`` as one tuple of tokens per sampling entry: one token,
    or for an entry with proposals the accepted ones (a prefix of them) and the model's next
    token. ValueError, with nothing changed, for anything else."""
    answers = list(next_tokens) if isinstance(next_tokens, Iterable) else None
    sampling = [e for e in batch.entries if e.samples]
    if answers is None or len(answers) != len(sampling):
        count = "a non-iterable" if answers is None else str(len(answers))
        raise ValueError(
            f"commit() needs one next token per sampling entry: {len(sampling)} of "
            f"{len(batch.entries)} entries sample, got {count} tokens"
        )
    checked = []
    for entry, answer in zip(sampling, answers, strict=True):
        tokens = (
            tuple(token_ids(answer, "next_tokens"))
            if isinstance(answer, (list, tuple))
            else tuple(token_ids([answer], "next_tokens"))
        )
        spec = entry.spec_token_ids
        if not 1 <= len(tokens) <= len(spec) + 1 or tokens[:-1] != spec[: len(tokens) - 1]:
            raise ValueError(
                f"commit(): seq_id {entry.seq.seq_id} was proposed {list(spec)}; its answer "
                f"must be the proposals accepted, in order, then one next token, got "
                f"{list(tokens)}"
            )
        checked.append(tokens)
    return checked


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def window_blocks(sliding_window: int, block_size: int) -> int:
    """The most blocks ``sliding_window`` consecutive positions can span (at the worst
    alignment): what a windowed sequence holds to decode, however long it is."""
    return -(-(sliding_window - 1) // block_size) + 1


def check_request_fits(scheduler, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise ``RequestTooLongError`` if a request could never run on ``scheduler`` (either
    backend's): its prompt + ``max_tokens`` - 1 tokens need more blocks than the whole pool,
    or, computing prompts whole, exceed the token budget (a preempted sequence is recomputed
    in one prefill). With a sliding window and chunked prefill, only the blocks of one window
    are needed at once (see the module doc)."""
    kv_tokens = num_prompt_tokens + max_tokens - 1
    what = f"prompt {num_prompt_tokens} + max_tokens {max_tokens} - 1 = {kv_tokens} tokens"
    if not scheduler.enable_chunked_prefill and kv_tokens > scheduler.max_num_batched_tokens:
        raise RequestTooLongError(
            f"request too long: {what} exceed max_num_batched_tokens "
            f"{scheduler.max_num_batched_tokens} (a preempted sequence is recomputed in one "
            "prefill; chunked prefill lifts this limit)"
        )
    blocks = _blocks_for(kv_tokens, scheduler.block_size)
    window = scheduler.sliding_window
    if window is not None and scheduler.enable_chunked_prefill:
        blocks = min(blocks, window_blocks(window, scheduler.block_size))
    if blocks > scheduler.pool.num_blocks:
        raise RequestTooLongError(
            f"request too long: {what} need {blocks} blocks of {scheduler.block_size}, "
            f"the whole pool has {scheduler.pool.num_blocks}"
        )


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (compared in chunks
    by list equality, which runs in C)."""
    n = 0
    while n < limit:
        end = min(n + 64, limit)
        if a[n:end] != b[n:end]:
            while a[n] == b[n]:
                n += 1
            return n
        n = end
    return limit


class _AdmissionPlan(NamedTuple):
    """What admitting a sequence would take, worked out before anything changes."""

    num_cached: int  # leading tokens whose KV is borrowed rather than computed
    num_blocks: int  # blocks its whole prompt removes from the available reserve
    cached_blocks: list[int]  # from the prefix cache ...
    cursor: PrefixCursor
    source: Sequence | None  # ... or from this running sequence's table
    num_revived: int  # idle cached blocks it borrows and keeps: they leave the reserve at once
    split_room: int  # free slots in a borrowed, partly filled block (0: none): 1 block to split


class Scheduler:
    """Continuous batching over a ``BlockPool`` (see the module docstring for the contract).

    ``prefix_sharing`` lets an admitted sequence borrow the longest computed prefix it shares
    with a running sequence (a partly shared last block is split on first write).
    ``prefix_caching`` replaces that with the prefix cache, which also remembers full blocks
    of finished sequences (``prefix_caching`` needs ``prefix_sharing``).
    ``enable_chunked_prefill`` computes prompts in chunks of the step's token budget.
    ``sliding_window`` (the model's, None for full attention) releases the blocks that fall
    out of every sequence's window as it advances (see the module doc).

    Inputs, checked before anything changes (the Cython mirror runs the same checks, so both
    backends accept and refuse the same values): sizes and limits are ints in
    [1, ``MAX_TOKEN_COUNT`` = 2**61 - 1], and so is the pool's capacity in tokens
    (``num_blocks * block_size``); token ids are ints in [0, ``MAX_TOKEN_ID`` = 2**63 - 1],
    NumPy integers included, bools not. Anything else is a ``ValueError`` (a pool that is not a
    ``BlockPool``: ``TypeError``).
    """

    def __init__(
        self,
        pool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        prefix_sharing: bool = True,
        prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = positive_int(block_size, "block_size")
        if sliding_window is not None:
            sliding_window = positive_int(sliding_window, "sliding_window")
        self.sliding_window = sliding_window
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs")
        self.max_num_batched_tokens = positive_int(max_num_batched_tokens, "max_num_batched_tokens")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({max_num_seqs}): every running sequence decodes every step"
            )
        if prefix_caching and not prefix_sharing:
            raise ValueError("prefix_caching=True needs prefix_sharing=True")
        if not callable(getattr(pool, "new_table", None)):
            raise TypeError(f"the Scheduler needs a BlockPool, got {pool!r}")
        check_capacity(pool.num_blocks, self.block_size)
        self.pool = pool
        self.prefix_sharing = bool(prefix_sharing)
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.prefix_cache = PrefixCache(pool, block_size) if prefix_caching else None
        self.waiting: deque[Sequence] = deque()  # FCFS; front = next to admit
        self.running: list[Sequence] = []  # admission order; back = next preemption victim
        self._next_seq_id = 0
        self._num_steps = 0
        self._pending: Batch | None = None
        # This step's counters, for its trace row.
        self._preemptions = self._recomputed = self._prefix_hits = 0

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def pending_batch(self) -> Batch | None:
        """The batch the last ``step()`` returned, until its ``commit`` or ``rollback``."""
        return self._pending

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- requests -------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Iterable[int],
        max_tokens: int,
        stop_token_ids: Iterable[int] = (),
        *,
        reuse_prefix: bool = True,
    ) -> Sequence:
        """Queue a request; raises ``RequestTooLongError`` (or ValueError) with nothing queued
        if it could never run. ``reuse_prefix=False``: the sequence computes its whole prompt
        even where a running sequence or the prefix cache could lend the KV, because the
        caller wants the logits of every prompt position (prompt log-probabilities)."""
        if not isinstance(reuse_prefix, bool):
            raise ValueError(f"reuse_prefix must be a bool, got {reuse_prefix!r}")
        prompt = token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        # Too many max_tokens for the pool is RequestTooLongError, below.
        max_tokens = positive_int(max_tokens, "max_tokens", limit=None)
        stops = token_ids(stop_token_ids, "stop_token_ids")
        check_request_fits(self, len(prompt), max_tokens)
        table = self.pool.new_table(self.block_size)
        seq = Sequence(self._next_seq_id, prompt, max_tokens, stops, table, reuse_prefix)
        self._next_seq_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: int) -> bool:
        """Remove a request from wherever it is and free its blocks now. False if it already
        finished or was aborted; KeyError for an id never handed out."""
        if not is_int(seq_id):
            raise KeyError(f"seq_id must be an int, got {seq_id!r}")
        if not 0 <= seq_id < self._next_seq_id:
            raise KeyError(f"no request with seq_id {seq_id} was ever submitted")
        for i, seq in enumerate(self.running):
            if seq.seq_id == seq_id:
                del self.running[i]
                self._free(seq)
                seq.finish_reason = FINISH_ABORT
                return True
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish_reason = FINISH_ABORT
                return True
        return False

    def clear_prefix_cache(self) -> None:
        """Forget every cached block; idle ones return to the free list."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.clear()
        for seq in self.running:
            seq.cache_cursor = None  # its chain's entries are gone

    # -- one step -------------------------------------------------------------------------
    def step(self, proposals: Mapping[int, Iterable[int]] | None = None) -> Batch:
        """Decode, continue prompts, admit; return the work for the model runner (see the
        module doc). ``proposals``: seq_id -> tokens proposed to follow that sequence's newest
        token (speculative decoding; ignored for a sequence not decoding this step).

        Raises ``SchedulerStallError``, with nothing changed, instead of returning an empty
        batch that no later step could change: requests waiting, nothing running, nothing
        admitted (see the class)."""
        if self._pending is not None:
            raise RuntimeError("step() called again before commit() of the previous batch")
        proposed = _checked_proposals(proposals)
        self._preemptions = self._recomputed = self._prefix_hits = 0
        scheduled: dict[int, BatchEntry] = {}  # seq_id -> its entry
        preempted: list[Sequence] = []
        self._decode(scheduled, preempted, proposed)
        budget = self.max_num_batched_tokens - sum(e.num_tokens for e in scheduled.values())
        if self.enable_chunked_prefill:
            budget = self._continue_prompts(scheduled, preempted, budget)
        self._admit(scheduled, preempted, budget)
        if self.waiting and not self.running and not preempted:
            # Nothing ran, so nothing was scheduled or changed, and nothing ever will be.
            raise stall_error(self)
        entries = tuple(scheduled[s.seq_id] for s in self.running if s.seq_id in scheduled)
        batch = Batch(self._num_steps, entries, tuple(preempted), self._trace(entries))
        self._pending = batch
        self._num_steps += 1
        return batch

    def _admit(self, scheduled: dict[int, BatchEntry], preempted: list, budget: int) -> None:
        """Step 3: admit from the front of ``waiting`` while slot, budget and memory last --
        unless this step preempted: memory is short, and the front of ``waiting`` is now the
        victim, which would be readmitted only to be preempted again."""
        if not self.waiting or preempted:
            return
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            plan = self._plan(seq)
            num_new = seq.num_tokens - plan.num_cached
            if self.enable_chunked_prefill:  # as much as the budget allows, memory holds
                available = self._num_available() - plan.num_revived
                num_new = min(num_new, budget, self._slots(available, plan.split_room))
                if num_new < 1:
                    return
            elif num_new > budget or plan.num_blocks > self._num_available():
                return
            self.waiting.popleft()
            self._borrow(seq, plan)
            grown = self._grow(seq, num_new)
            assert grown, "admission was planned to fit"
            self.running.append(seq)
            scheduled[seq.seq_id] = BatchEntry(seq, plan.num_cached, num_new, is_prefill=True)
            budget -= num_new
            self._prefix_hits += plan.num_cached
            self._recomputed += max(0, min(seq.num_tokens, seq.peak_computed) - plan.num_cached)

    def _continue_prompts(
        self, scheduled: dict[int, BatchEntry], preempted: list[Sequence], budget: int
    ) -> int:
        """Step 2: the next chunk of every running sequence still inside its prompt, in
        admission order; return the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in scheduled:  # decoding this step
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            num_new = min(num_new, max(1, self._tokens_that_fit(seq.table)))
            while not self._grow(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, scheduled, preempted)
                if victim is seq:
                    break
            else:
                entry = BatchEntry(seq, seq.num_computed, num_new, is_prefill=True)
                scheduled[seq.seq_id] = entry
                budget -= num_new
                i += 1
        return budget

    def _slots(self, num_blocks: int, split_room: int) -> int:
        """Token slots that ``num_blocks`` available blocks give a table whose last block has
        ``split_room`` free slots but is shared (splitting it takes one of the blocks)."""
        if split_room:
            return split_room + (num_blocks - 1) * self.block_size if num_blocks else 0
        return num_blocks * self.block_size

    def _tokens_that_fit(self, table) -> int:
        """Tokens ``table`` can grow by with the blocks available now."""
        room = -table.num_tokens % self.block_size  # free slots in its last block
        if room and self.pool.refcount(table.blocks[-1]) > 1:
            return self._slots(self._num_available(), room)
        return room + self._slots(self._num_available(), 0)

    def _plan(self, seq: Sequence) -> _AdmissionPlan:
        """What admitting ``seq`` takes: the prefix it borrows, and the blocks its whole
        prompt needs beyond that (a chunk may need fewer: see ``_slots``)."""
        n, bs = seq.num_tokens, self.block_size
        if not seq.reuse_prefix:
            return _AdmissionPlan(0, _blocks_for(n, bs), [], PrefixCursor(), None, 0, 0)
        if self.prefix_cache is not None:
            blocks, cursor = self.prefix_cache.lookup(seq.token_ids, (n - 1) // bs)
            if len(blocks) == (n - 1) // bs and (n - 1) % bs:
                # Every full block it may borrow is cached. A running sequence holding these
                # very blocks may also lend the partly filled one after them (a forked
                # sample's prompt): borrowed, then split by copy-on-write at the first write.
                source, common = self._longest_running_prefix(seq)
                if common > len(blocks) * bs and list(source.table.blocks[: len(blocks)]) == blocks:
                    needed = _blocks_for(n, bs) - len(blocks)
                    return _AdmissionPlan(common, needed, [], cursor, source, 0, -common % bs)
            # Idle cached blocks it borrows leave the reusable reserve, like fresh ones --
            # except those wholly before its window: ``_borrow`` gives them back at once, and
            # idle again they are evictable again. Counting them as taken would make a
            # request whose borrowed prefix is longer than its window look short of memory
            # in a pool holding nothing but that prefix: nothing would ever be admitted.
            kept = blocks[self._released_after(len(blocks) * bs) :]
            revived = self.prefix_cache.count_evictable(kept)
            needed = _blocks_for(n, bs) - len(blocks) + revived
            return _AdmissionPlan(len(blocks) * bs, needed, blocks, cursor, None, revived, 0)
        source, common = self._longest_running_prefix(seq) if self.prefix_sharing else (None, 0)
        # A partly shared last block is borrowed, then copied on write: only the full shared
        # blocks are saved.
        needed = _blocks_for(n, bs) - common // bs
        return _AdmissionPlan(common, needed, [], PrefixCursor(), source, 0, -common % bs)

    def _longest_running_prefix(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """The running sequence sharing the longest *computed* prefix with ``seq``, capped at
        ``seq.num_tokens - 1`` (the last token is always computed, for its logits)."""
        best, best_len = None, 0
        limit = seq.num_tokens - 1
        for other in self.running:
            if other.table.num_released:  # its first blocks are gone: nothing to lend
                continue
            n = _common_prefix_len(seq.token_ids, other.token_ids, min(limit, other.num_computed))
            if n > best_len:
                best, best_len = other, n
        return best, best_len

    def _borrow(self, seq: Sequence, plan: _AdmissionPlan) -> None:
        if plan.cached_blocks:
            seq.table.borrow_blocks(plan.cached_blocks, plan.num_cached)
            self.prefix_cache.acquire(plan.cached_blocks)
        elif plan.source is not None:
            seq.table.borrow_prefix(plan.source.table, plan.num_cached)
        seq.num_computed = plan.num_cached
        seq.cache_cursor = plan.cursor
        self._release_out_of_window(seq)

    def _decode(
        self,
        scheduled: dict[int, BatchEntry],
        preempted: list[Sequence],
        proposed: dict[int, tuple[int, ...]],
    ) -> None:
        """Step 1: a slot for the newest token of every running sequence past its prompt
        (one whose only uncomputed token is its last), preempting LIFO when memory is out;
        and slots for its proposed tokens, as many as the budget left after everyone's one
        token, its ``max_tokens`` and the free memory allow (never preempting for them)."""
        spare = self.max_num_batched_tokens - sum(
            s.num_computed == s.num_tokens - 1 for s in self.running
        )
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_computed < seq.num_tokens - 1:  # inside its prompt: step 2's work
                i += 1
                continue
            spec = proposed.get(seq.seq_id, ())
            # The tokens after the accepted ones: at most max_tokens - generated, one of which
            # is the model's own.
            spec = spec[: max(0, min(spare, seq.max_tokens - seq.num_output_tokens - 1))]
            if spec and self._grow(seq, 1 + len(spec)):
                scheduled[seq.seq_id] = BatchEntry(
                    seq, seq.num_computed, 1 + len(spec), is_prefill=False, spec_token_ids=spec
                )
                spare -= len(spec)
                i += 1
                continue
            while not self._grow(seq, 1):
                victim = self.running[-1]
                self._preempt(victim, scheduled, preempted)
                if victim is seq:
                    break  # no victim was left: the requester itself went back
            else:
                scheduled[seq.seq_id] = BatchEntry(seq, seq.num_computed, 1, is_prefill=False)
                i += 1

    def _preempt(
        self, seq: Sequence, scheduled: dict[int, BatchEntry], preempted: list[Sequence]
    ) -> None:
        """Drop ``seq``'s blocks, keep its tokens, put it back at the front of ``waiting``."""
        assert self.running[-1] is seq, "victims are taken from the back"
        self.running.pop()
        scheduled.pop(seq.seq_id, None)
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        preempted.append(seq)
        self._preemptions += 1

    # -- memory ---------------------------------------------------------------------------
    def _num_available(self) -> int:
        """Blocks an allocation can get: free ones, and idle cached ones it may evict."""
        cached = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.pool.num_free + cached

    def _blocks_to_write(self, table, n: int) -> int:
        """Blocks that appending ``n`` tokens to ``table`` and making them writable takes."""
        cost = table.blocks_needed(n)
        if table.num_tokens % self.block_size and self.pool.refcount(table.blocks[-1]) > 1:
            cost += 1  # the shared, partly filled last block is split (copy-on-write)
        return cost

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Reserve slots for ``n`` more tokens, all in writable blocks; False, with nothing
        changed, if the memory isn't there.

        Only the block holding the first new token can be shared (the ones after it are
        fresh), and only without the prefix cache: cached blocks are full and computed, and
        a sequence writes past them. Idle cached blocks are evicted, LRU first, only when the
        free list alone is short.
        """
        table = seq.table
        cost = self._blocks_to_write(table, n)
        if cost > self._num_available():
            return False
        if cost > self.pool.num_free:
            self.prefix_cache.evict(cost - self.pool.num_free)
        start = table.num_tokens
        table.append_tokens(n)
        if self.pool.refcount(table.blocks[start // self.block_size]) > 1:
            table.writable_block(start)
        return True

    def _released_after(self, num_computed: int) -> int:
        """How many leading blocks a sequence that has computed ``num_computed`` tokens no
        longer holds: those wholly before its window, which ``_release_out_of_window`` gives
        back (0 without a window). Admission plans with it: a borrowed prefix longer than the
        window is released, in part, in the very step that borrows it."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks wholly before its window: no query from position
        ``num_computed`` on reads a position before ``num_computed - sliding_window + 1``.
        Cached ones that only the prefix cache holds now become evictable."""
        if self.sliding_window is None:
            return
        first = seq.num_computed - self.sliding_window + 1
        if first <= 0:
            return
        dropped = seq.table.release_before(first)
        if dropped and self.prefix_cache is not None:
            self.prefix_cache.release(reversed(dropped))

    def _free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (finish, abort, preemption)."""
        blocks = seq.table.blocks[seq.table.num_released :]
        seq.table.release()
        if self.prefix_cache is not None:
            self.prefix_cache.release(reversed(blocks))
        seq.cache_cursor = PrefixCursor()

    # -- the runner's answer ----------------------------------------------------------------
    def commit(self, batch: Batch, next_tokens: Iterable[int]) -> list[Sequence]:
        """Take the runner's next token for each entry of the last ``step()``'s batch; return
        the sequences that finished (already reaped: out of ``running``, blocks released).

        ``next_tokens`` holds one token per entry that samples (``entry.samples``), in entry
        order; a chunk ending inside its prompt only has its tokens marked computed. For an
        entry with proposals it may be a list: the accepted proposals, then the model's next
        token (see the module doc). Raises ValueError, with nothing changed, for another batch
        or a wrong token list.
        """
        if batch is not self._pending:
            raise ValueError("commit() takes the batch the last step() returned, exactly once")
        answers = _checked_answers(batch, next_tokens)
        self._pending = None
        finished = []
        next_answer = iter(answers)
        for entry in batch.entries:
            seq = entry.seq
            tokens = next(next_answer) if entry.samples else ()
            if seq.finish_reason == FINISH_ABORT:
                continue  # aborted between step() and commit()
            num_computed = entry.context_len
            if entry.spec_token_ids:  # KV of the newest token and the accepted proposals
                num_computed -= len(entry.spec_token_ids) - (len(tokens) - 1)  # the rejected
                seq.table.truncate(num_computed)
            # Tokens first: the accepted proposals' KV is computed, and the blocks holding it
            # are registered by their token ids.
            for token in tokens:
                seq.append_token(token)
                if seq.finished:  # a stop token among the accepted: the rest are dropped
                    finished.append(seq)
                    break
            seq.num_computed = min(num_computed, seq.num_tokens)  # none past such a stop
            seq.peak_computed = max(seq.peak_computed, seq.num_computed)
            self._register_full_blocks(seq)  # before the window releases any of them
            self._release_out_of_window(seq)
        if finished:
            self.running[:] = [s for s in self.running if not s.finished]
            for seq in finished:
                self._free(seq)
        return finished

    def rollback(self, batch: Batch) -> list[Sequence]:
        """Undo the last ``step()`` when its runner failed: every running sequence goes back
        to the front of ``waiting``, in order, to be recomputed; return them.

        After ``step()`` every running sequence has an entry in the batch, and some of their
        blocks hold KV the failed runner may have half written, so none of it can be trusted:
        all their blocks are released (as in a preemption) and no token is lost. Blocks the
        prefix cache registered earlier hold KV from committed steps and stay cached, so the
        recompute mostly hits the cache. ``running + waiting`` keeps its arrival order.
        """
        if batch is not self._pending:
            raise ValueError("rollback() takes the batch the last step() returned, exactly once")
        self._pending = None
        requeued = list(self.running)
        while self.running:
            seq = self.running.pop()
            self._free(seq)
            seq.num_computed = 0
            self.waiting.appendleft(seq)
        return requeued

    def _register_full_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_computed // self.block_size
        cursor = seq.cache_cursor
        if self.prefix_cache is None or cursor is None or cursor.num_blocks >= num_full:
            return
        seq.cache_cursor = self.prefix_cache.register(
            cursor, seq.table.blocks, seq.token_ids, num_full
        )

    # -- observation ----------------------------------------------------------------------
    def _blocks_held_by_tables(self) -> int:
        cached = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return self.pool.num_blocks - self.pool.num_free - cached

    def _trace(self, entries: tuple[BatchEntry, ...]) -> StepTrace:
        held = self._blocks_held_by_tables()
        # What the tables hold: released leading blocks (a sliding window's) are neither
        # listed nor KV.
        released = sum(s.table.num_released for s in self.running)
        listed = sum(s.table.num_blocks for s in self.running) - released
        kv_tokens = sum(s.table.num_tokens for s in self.running) - released * self.block_size
        reserved, capacity = held * self.block_size, self.pool.num_blocks * self.block_size
        return StepTrace(
            step=self._num_steps,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_prefill_tokens=sum(e.num_tokens for e in entries if e.is_prefill),
            num_decode_tokens=sum(e.num_tokens for e in entries if not e.is_prefill),
            utilization=reserved / capacity,
            reserved_tokens=reserved,
            capacity_tokens=capacity,
            kv_tokens=kv_tokens,
            internal_fragmentation=listed * self.block_size - kv_tokens,
            sharing_saved_fraction=1 - held / listed if listed else 0.0,
            cached_blocks=self.prefix_cache.num_evictable if self.prefix_cache else 0,
            preemptions=self._preemptions,
            recomputed_tokens=self._recomputed,
            prefix_hit_tokens=self._prefix_hits,
            spec_tokens=sum(len(e.spec_token_ids) for e in entries),
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds (``check_integrity``)."""
        check_integrity(self)
