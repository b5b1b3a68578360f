"""Greedy packing with slot limits, many rows at once: the shared core of EPLB's
`balanced_packing` and SmartMoE's greedy mapping (`permute.greedy_homes`).

`lpt_assign(weight[X, n], packs, capacity, sticky)` (X rows of n items): in each row the items
are taken in the given order (callers sort them heaviest first) and each goes to the pack with the
least load among those holding fewer than `capacity` items (lowest pack index on ties); with
`sticky[X, n]`, item t goes to pack `sticky[r, t]` instead when that pack is not full and its
load equals the least (SmartMoE's stickiness). Loads accumulate item by item, `load += weight`,
as a plain loop would.

The greedy is sequential: each choice depends on every earlier one, and a loop over the items
costs a dozen NumPy calls per item (256 items: 3 ms). Longest-processing-time greedy mostly deals
the items out in rounds, though: the next items go to the open packs in order of load, one each,
until a pack that already got one in the round is the lightest again. So each step guesses a
whole round (the k-th next item to the k-th lightest open pack) and checks every guess at once:
item t's guess is right when the packs already given an item in the round (their loads now
known, `[X, T]` prefix minima) are all heavier than the t-th lightest, and no sticky pack ties.
The round is kept up to the first wrong guess, whose right pack is then worked out exactly
(its state is known); so every step keeps at least one item, mostly a whole round. A second
guess, the lightest pack taking the next items while it stays the lightest, covers the small
items late in the greedy; with stickiness the first round (all packs empty, all tied) is the
claims of `claims`. Where rounds stay short (ties: equal or zero weights, sticky packs at equal
loads, few open packs), steps fall back to the plain loop for a while (`one_by_one`), and with
fewer than `MIN_PACKS` packs the plain loop does it all. Either way the result is the loop's,
bit for bit: the same choices, the loads the same sums in the same order.

Bookkeeping (no effect on the choices): a pack's key, its load while it has room and inf once
full, is kept up to date rather than recomputed from the loads and counts at every step; and
while every row is at the same item (`_State.lockstep`, as in EPLB's packing, where every row
has the same items per pack) a round works on whole rows and item slices, without gathers.
"""

from __future__ import annotations

import numpy as np

MIN_PACKS = 16  # fewer packs: the plain loop (a round keeps at most one item per pack)
MIN_ROUND = 4  # a step keeping fewer items on average falls back to the plain loop ...
LOOP_STEPS = 8  # ... for this many items, doubled while rounds stay short


def lpt_assign(
    weight: np.ndarray,
    packs: int,
    capacity: int,
    sticky: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`weight[X, n]` in processing order -> `(pack[X, n], rank[X, n])`: each item's pack and
    the number of items the pack held before it. Needs `packs * capacity >= n`."""
    weight = np.ascontiguousarray(weight, dtype=np.float64)
    if packs < MIN_PACKS:  # rounds of a few items cannot beat the loop
        return _loop(weight, packs, capacity, sticky)
    state = _State(weight, packs, capacity, sticky)
    if sticky is not None:
        state.claims()
    loop_steps = LOOP_STEPS
    while state.active.size:
        kept = state.round()
        if kept < MIN_ROUND and state.active.size:
            state.one_by_one(loop_steps)
            loop_steps *= 2
        else:
            loop_steps = LOOP_STEPS
    return state.pack_of, state.rank


def _loop(
    weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """`lpt_assign` as the plain loop: one item of every row per step."""
    X = weight.shape[0]
    key = np.zeros((X, packs))
    count = np.zeros((X, packs), dtype=np.int64)
    pack_of, rank = _steps(key, count, capacity, weight.T, None if sticky is None else sticky.T)
    return pack_of.T, rank.T


def _steps(
    key: np.ndarray,
    count: np.ndarray,
    capacity: int,
    weight_t: np.ndarray,
    sticky_t: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The plain loop over the items `weight_t[s, B]` (step-major) of B rows whose packs have
    keys `key[B, P]` (load, or inf once full) and item counts `count[B, P]`, both contiguous and
    updated in place -> `(pack[s, B], rank[s, B])`. Indexed flat: row b's pack p at b * P + p."""
    B, P = key.shape
    first = np.arange(B) * P  # flat index of each row's pack 0
    flat_key = key.reshape(-1)  # views: writes through them update `key` and `count`
    flat_count = count.reshape(-1)
    s = weight_t.shape[0]
    pack_of = np.empty((s, B), dtype=np.int64)
    rank = np.empty((s, B), dtype=np.int64)
    weight_t = np.ascontiguousarray(weight_t)
    sticky_t = None if sticky_t is None else np.ascontiguousarray(sticky_t)
    for t in range(s):
        pack = key.argmin(axis=1)  # least load, lowest index
        if sticky_t is not None:
            cur = sticky_t[t]
            pack = np.where(flat_key[first + cur] == flat_key[first + pack], cur, pack)
        at = first + pack
        filled = flat_count[at]
        pack_of[t] = pack
        rank[t] = filled
        filled += 1
        flat_count[at] = filled
        flat_key[at] = np.where(filled < capacity, flat_key[at] + weight_t[t], np.inf)
    return pack_of, rank


class _State:
    """The greedy's state for every row: pack keys (the load while the pack has room, inf once
    full) and item counts, the next item of each row."""

    def __init__(
        self, weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None
    ) -> None:
        X, n = weight.shape
        self.weight, self.sticky, self.capacity, self.n = weight, sticky, capacity, n
        self.pack_of = np.zeros((X, n), dtype=np.int64)
        self.rank = np.zeros((X, n), dtype=np.int64)
        self.key = np.zeros((X, packs))
        self.count = np.zeros((X, packs), dtype=np.int64)
        self.pos = np.zeros(X, dtype=np.int64)  # next item of each row
        self.active = np.arange(X) if n else np.zeros(0, dtype=np.int64)
        self.every_row = np.arange(X)[:, None]  # [X, 1], to pair with per-row pack indices
        self.first_pack = self.every_row * packs  # flat index of each row's pack 0 in `key`
        self.lockstep = True  # every row still active, all at the same next item

    def _commit(self, rows: np.ndarray, items: np.ndarray, packs: np.ndarray) -> None:
        """Item `items[i]` of row `rows[i]` goes to `packs[i]`; at most one item per pack and
        row per call, items in order."""
        at_item = rows * self.n + items  # flat indices into [X, n] and [X, packs]
        at_pack = rows * self.key.shape[1] + packs
        self.pack_of.ravel()[at_item] = packs
        flat_count, flat_key = self.count.ravel(), self.key.ravel()
        filled = flat_count[at_pack]
        self.rank.ravel()[at_item] = filled
        filled += 1
        flat_count[at_pack] = filled
        load = flat_key[at_pack] + self.weight.ravel()[at_item]
        flat_key[at_pack] = np.where(filled < self.capacity, load, np.inf)

    def _advance(self, rows: np.ndarray, steps: np.ndarray | int) -> None:
        self.pos[rows] += steps
        self.active = self.active[self.pos[self.active] < self.n]

    def claims(self) -> None:
        """The first round from empty packs with stickiness: while some pack is still empty
        and the items weigh more than nothing, every empty pack ties at load 0 and every other
        is heavier, so item t takes its sticky pack if that is still empty, else the lowest
        empty one. Only a boolean mask changes from item to item."""
        X = self.weight.shape[0]
        assert self.sticky is not None
        packs = self.key.shape[1]
        positive = np.minimum.accumulate(self.weight > 0, axis=1).sum(axis=1)  # leading w > 0
        steps = np.minimum(positive, packs)
        T = int(steps.max(initial=0))
        if T == 0:
            return
        rows = np.arange(X)
        empty = np.ones((X, packs), dtype=bool)
        chosen = np.zeros((T, X), dtype=np.int64)
        sticky_t = np.ascontiguousarray(self.sticky[:, :T].T)  # [T, X]
        # Every row walks T <= packs steps (some pack is empty at each); a row's steps past its
        # own `steps` only change its own later choices, which are not kept.
        for t in range(T):
            cur = sticky_t[t]
            pack = np.where(empty[rows, cur], cur, empty.argmax(axis=1))  # first empty
            empty[rows, pack] = False
            chosen[t] = pack
        chosen = chosen.T
        r_idx, t_idx = np.nonzero(np.arange(T)[None, :] < steps[:, None])
        self._commit(r_idx, t_idx, chosen[r_idx, t_idx])
        self._advance(rows, steps)
        self.lockstep = bool(steps.min() == steps.max())

    def one_by_one(self, steps: int) -> None:
        """The plain loop (`_steps`) for up to `steps` items of every active row, on the rows'
        state gathered once per stretch of steps that every row still has items for."""
        while steps > 0 and self.active.size:
            rows = self.active
            pos = self.pos[rows]
            s = min(steps, self.n - int(pos.max()))
            if self.lockstep:  # every row at item p: whole arrays, item slices
                p = int(pos[0])
                items: slice | np.ndarray = slice(p, p + s)
                key, count = self.key, self.count
                weight = self.weight[:, items]
                sticky = None if self.sticky is None else self.sticky[:, items]
                at: tuple = (slice(None), items)
            else:
                items = pos[:, None] + np.arange(s)
                key, count = self.key[rows], self.count[rows]
                weight = self.weight[rows[:, None], items]
                sticky = None if self.sticky is None else self.sticky[rows[:, None], items]
                at = (rows[:, None], items)
            pack, rank = _steps(
                key, count, self.capacity, weight.T, None if sticky is None else sticky.T
            )
            self.pack_of[at] = pack.T
            self.rank[at] = rank.T
            if not self.lockstep:
                self.key[rows] = key
                self.count[rows] = count
            self._advance(rows, s)
            steps -= s

    def round(self) -> float:
        """Guess a round for every active row, keep it up to its first wrong guess (that item
        placed exactly); returns the number of items kept, mean over the rows."""
        rows = self.active
        B = rows.size
        cap, n, lock = self.capacity, self.n, self.lockstep
        if lock:  # every row at item p: whole arrays and item slices instead of gathers
            b, first_pack = self.every_row, self.first_pack
            key0, count, pos = self.key, self.count, self.pos
            p = int(pos[0])
        else:
            b = np.arange(B)[:, None]
            first_pack = b * self.key.shape[1]
            key0, count, pos = self.key[rows], self.count[rows], self.pos[rows]
        by_load = np.argsort(key0, axis=1, kind="stable")  # open packs by (load, index) first
        left = n - pos
        if lock and int(count.max()) < cap:  # every pack open: rounds of min(P, items left)
            T = min(count.shape[1], n - p)
            size, uniform = np.full(B, T), True
        else:
            size = np.minimum((count < cap).sum(axis=1), left)  # items in each row's round
            T = int(size.max())
            uniform = bool(size.min() == T)
        t = np.arange(T)[None, :]
        if lock:
            item: slice | np.ndarray = slice(p, p + T)  # p + T <= n
            w = self.weight[:, item]  # [B, T]
        else:
            item = np.minimum(pos[:, None] + t, n - 1)
            w = self.weight[rows[:, None], item]
        guess = by_load[:, :T]  # item t -> the t-th lightest open pack
        at = first_pack + guess  # flat indices into key0 and count (contiguous)
        base = key0.ravel()[at]  # its load before the round
        filled = count.ravel()[at]
        filled_after = filled + 1
        after_key = np.where(filled_after < cap, base + w, np.inf)  # ... after taking item t
        # Least key among the packs already given an item in the round, before item t.
        before_min = np.empty((B, T))
        before_min[:, 0] = np.inf
        np.minimum.accumulate(after_key[:, :-1], axis=1, out=before_min[:, 1:])
        right = before_min > base  # strictly: a tie may go to a lower index
        if self.sticky is not None:
            least = np.minimum(before_min, base)
            cur = self.sticky[:, item] if lock else self.sticky[rows[:, None], item]
            pos_cur = np.argsort(by_load, axis=1)[b, cur]  # cur's place in the round order
            touched = pos_cur < t
            cur_key = np.where(touched, after_key[b, np.minimum(pos_cur, T - 1)], key0[b, cur])
            right &= ~((cur_key == least) & (cur != guess))
        if not uniform:
            right |= t >= size[:, None]  # past a row's round: nothing to check
        all_right = bool(right.all())
        if all_right and lock and uniform and T >= 2 * MIN_ROUND:
            # Every row keeps its whole round of T items, at p ... p + T - 1.
            self.pack_of[:, item] = guess
            self.rank[:, item] = filled
            self.key.ravel()[at] = after_key  # load + weight, as `_commit` adds it
            self.count.ravel()[at] = filled_after
            self.pos += T
            if p + T == n:
                self.active = self.active[:0]
            return float(T)
        if all_right:
            first = np.full(B, T)
        else:
            wrong = ~right
            first = np.where(wrong.any(axis=1), wrong.argmax(axis=1), T)  # first wrong guess
        kept = np.minimum(first + 1, size)
        # Rounds cut short: the run guess (the lightest pack takes the next items) may keep more.
        stop = np.minimum(first, size)  # items kept from the round guess
        short = np.flatnonzero((kept < size) | (kept < 2 * MIN_ROUND))
        use_run = np.zeros(B, dtype=bool)
        if short.size:
            run, run_load = self._run(
                rows[short], by_load[short, 0], by_load[short, 1:2], key0[short], left[short]
            )
            better = run > kept[short]
            use_run[short[better]] = True
            kept[short[better]] = run[better]
            stop[short[better]] = 0
            self._commit_run(
                rows[short[better]], by_load[short[better], 0], run[better], run_load[better]
            )
        # Rows keeping their round: items before the first wrong guess go to distinct packs,
        # with the loads and counts worked out above (as `_commit` would).
        keep = np.flatnonzero(t < stop[:, None])  # flat indices into the [B, T] arrays
        r_idx = keep // T
        at_rows, at_packs = rows[r_idx], guess.ravel()[keep]
        at_item = at_rows * n + pos[r_idx] + (keep - r_idx * T)
        at_pack = at_rows * self.key.shape[1] + at_packs
        self.pack_of.ravel()[at_item] = at_packs
        self.rank.ravel()[at_item] = filled.ravel()[keep]
        self.key.ravel()[at_pack] = after_key.ravel()[keep]
        self.count.ravel()[at_pack] = filled_after.ravel()[keep]
        # The first wrong item: its exact choice, from the round's state before it.
        bad = np.flatnonzero((first < size) & ~use_run)
        if bad.size:
            self._place_exact(rows[bad], first[bad], guess[bad], after_key[bad], base[bad])
        self._advance(rows, kept)
        X = self.pos.size
        self.lockstep = self.active.size == X and bool((self.pos == self.pos[0]).all())
        return int(kept.sum()) / B

    def _commit_run(
        self, rows: np.ndarray, pack: np.ndarray, run: np.ndarray, loads: np.ndarray
    ) -> None:
        """The next `run[i]` items of row `rows[i]` go to `pack[i]`, whose running loads are
        `loads[i]` (`loads[i, run[i]]` after them)."""
        if not rows.size:
            return
        rr, tt = np.nonzero(np.arange(int(run.max()))[None, :] < run[:, None])
        item = self.pos[rows][rr] + tt
        self.pack_of[rows[rr], item] = pack[rr]
        before = self.count[rows, pack]
        self.rank[rows[rr], item] = before[rr] + tt
        filled = before + run
        self.count[rows, pack] = filled
        self.key[rows, pack] = np.where(
            filled < self.capacity, loads[np.arange(rows.size), run], np.inf
        )

    def _run(
        self,
        rows: np.ndarray,
        p0: np.ndarray,
        p1: np.ndarray,
        key0: np.ndarray,
        left: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The other guess: the lightest open pack `p0` takes the next items while it stays the
        lightest (before the second lightest `p1[:, :1]`, if any; small items late in the
        greedy). Returns, per row, how many items that guess gets right, and the pack's running
        loads `[B, T + 1]` before each of them."""
        B = rows.size
        b = np.arange(B)
        if p1.shape[1]:
            p1 = p1[:, 0]
            key1 = key0[b, p1]
        else:
            p1, key1 = np.zeros(B, dtype=np.int64), np.full(B, np.inf)
        count0 = self.count[rows, p0]
        T = int(min(left.max(), self.capacity - count0.min()))
        t = np.arange(T)[None, :]
        item = np.minimum(self.pos[rows][:, None] + t, self.n - 1)
        w = self.weight[rows[:, None], item]
        loads = np.cumsum(np.concatenate([key0[b, p0][:, None], w], axis=1), axis=1)
        before = loads[:, :-1]  # p0's load before item t
        ok = (before < key1[:, None]) | ((before == key1[:, None]) & (p0 < p1)[:, None])
        ok &= (count0[:, None] + t < self.capacity) & (t < left[:, None])
        if self.sticky is not None:
            cur = self.sticky[rows[:, None], item]
            ok &= (cur == p0[:, None]) | (key0[b[:, None], cur] != before)
        run = np.where(ok.all(axis=1), T, (~ok).argmax(axis=1))
        return run, loads

    def _place_exact(
        self,
        rows: np.ndarray,
        first: np.ndarray,
        guess: np.ndarray,
        after_key: np.ndarray,
        base: np.ndarray,
    ) -> None:
        """Place item `first[i]` of the round of row `rows[i]` (its earlier items already
        committed) by the greedy's rule: the least key (lowest index on ties) among the packs
        given an item in the round and the untouched `guess[first]`, or its sticky pack."""
        B, T = guess.shape
        b = np.arange(B)
        t = np.arange(T)[None, :]
        earlier = t < first[:, None]
        # Lexicographic (key, pack) minimum over the earlier packs and the t-th lightest.
        cand_key = np.where(earlier, after_key, np.inf)
        cand_key[b, first] = base[b, first]
        best = cand_key.min(axis=1)
        tie = cand_key == best[:, None]
        pack = np.where(tie, guess, np.iinfo(np.int64).max).min(axis=1)
        item = self.pos[rows] + first
        if self.sticky is not None:
            cur = self.sticky[rows, item]
            pack = np.where(self.key[rows, cur] == best, cur, pack)
        self._commit(rows, item, pack)
