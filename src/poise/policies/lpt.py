"""Greedy packing with slot limits, many rows at once: the shared core of EPLB's
`balanced_packing` and SmartMoE's greedy mapping (`permute.greedy_homes`).

`lpt_assign(weight[R, n], packs, capacity, sticky)`: in each row the items are taken in the given
order (callers sort them heaviest first) and each goes to the pack with the least load among
those holding fewer than `capacity` items (lowest pack index on ties); with `sticky[R, n]`, item
t goes to pack `sticky[r, t]` instead when that pack is not full and its load equals the least
(SmartMoE's stickiness). Loads accumulate item by item, `load += weight`, as a plain loop would.

The greedy is sequential: each choice depends on every earlier one, and a loop over the items
costs a dozen NumPy calls per item (256 items: 3 ms). Longest-processing-time greedy mostly deals
the items out in rounds, though: the next items go to the open packs in order of load, one each,
until a pack that already got one in the round is the lightest again. So each step guesses a
whole round (the k-th next item to the k-th lightest open pack) and checks every guess at once:
item t's guess is right when the packs already given an item in the round (their loads now
known, `[R, T]` prefix minima) are all heavier than the t-th lightest, and no sticky pack ties.
The round is kept up to the first wrong guess, whose right pack is then worked out exactly
(its state is known); so every step keeps at least one item, mostly a whole round. A second
guess, the lightest pack taking the next items while it stays the lightest, covers the small
items late in the greedy; with stickiness the first round (all packs empty, all tied) is the
claims of `claims`. Where rounds stay short (ties: equal or zero weights, sticky packs at equal
loads, few open packs), steps fall back to the plain loop for a while (`one_by_one`), and with
fewer than `MIN_PACKS` packs the plain loop does it all. Either way the result is the loop's,
bit for bit: the same choices, the loads the same sums in the same order.
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
    """`weight[R, n]` in processing order -> `(pack[R, n], rank[R, n])`: each item's pack and
    the number of items the pack held before it. Needs `packs * capacity >= n`."""
    weight = np.asarray(weight, dtype=np.float64)
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
    R, n = weight.shape
    rows = np.arange(R)
    pack_of = np.zeros((n, R), dtype=np.int64)
    rank = np.zeros((n, R), dtype=np.int64)
    load = np.zeros((R, packs))
    count = np.zeros((R, packs), dtype=np.int64)
    weight_t = np.ascontiguousarray(weight.T)
    sticky_t = None if sticky is None else np.ascontiguousarray(sticky.T)
    for t in range(n):
        key = np.where(count < capacity, load, np.inf)
        pack = key.argmin(axis=1)  # least load, lowest index
        if sticky_t is not None:
            cur = sticky_t[t]
            pack = np.where(key[rows, cur] == key[rows, pack], cur, pack)  # inf != finite least
        pack_of[t] = pack
        rank[t] = count[rows, pack]
        load[rows, pack] += weight_t[t]
        count[rows, pack] += 1
    return pack_of.T, rank.T


class _State:
    """The greedy's state for every row: loads and item counts per pack, the next item."""

    def __init__(
        self, weight: np.ndarray, packs: int, capacity: int, sticky: np.ndarray | None
    ) -> None:
        R, n = weight.shape
        self.weight, self.sticky, self.capacity, self.n = weight, sticky, capacity, n
        self.pack_of = np.zeros((R, n), dtype=np.int64)
        self.rank = np.zeros((R, n), dtype=np.int64)
        self.load = np.zeros((R, packs))
        self.count = np.zeros((R, packs), dtype=np.int64)
        self.pos = np.zeros(R, dtype=np.int64)  # next item of each row
        self.active = np.arange(R) if n else np.zeros(0, dtype=np.int64)

    def _commit(self, rows: np.ndarray, items: np.ndarray, packs: np.ndarray) -> None:
        """Item `items[i]` of row `rows[i]` goes to `packs[i]`; at most one item per pack and
        row per call, items in order."""
        self.pack_of[rows, items] = packs
        self.rank[rows, items] = self.count[rows, packs]
        self.load[rows, packs] += self.weight[rows, items]
        self.count[rows, packs] += 1

    def _advance(self, rows: np.ndarray, steps: np.ndarray) -> None:
        self.pos[rows] += steps
        self.active = self.active[self.pos[self.active] < self.n]

    def claims(self) -> None:
        """The first round from empty packs with stickiness: while some pack is still empty
        and the items weigh more than nothing, every empty pack ties at load 0 and every other
        is heavier, so item t takes its sticky pack if that is still empty, else the lowest
        empty one. Only a boolean mask changes from item to item."""
        R = self.weight.shape[0]
        assert self.sticky is not None
        packs = self.load.shape[1]
        positive = np.minimum.accumulate(self.weight > 0, axis=1).sum(axis=1)  # leading w > 0
        steps = np.minimum(positive, packs)
        T = int(steps.max(initial=0))
        if T == 0:
            return
        rows = np.arange(R)
        empty = np.ones((R, packs), dtype=bool)
        chosen = np.zeros((T, R), dtype=np.int64)
        sticky_t = np.ascontiguousarray(self.sticky[:, :T].T)  # [T, R]
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

    def one_by_one(self, steps: int) -> None:
        """The plain loop for up to `steps` items of every active row."""
        for _ in range(steps):
            rows = self.active
            if not rows.size:
                return
            item = self.pos[rows]
            key = np.where(self.count[rows] < self.capacity, self.load[rows], np.inf)
            pack = key.argmin(axis=1)  # least load, lowest index
            if self.sticky is not None:
                cur = self.sticky[rows, item]
                b = np.arange(rows.size)
                pack = np.where(key[b, cur] == key[b, pack], cur, pack)  # inf != finite least
            self._commit(rows, item, pack)
            self._advance(rows, np.ones(rows.size, dtype=np.int64))

    def round(self) -> int:
        """Guess a round for every active row, keep it up to its first wrong guess (that item
        placed exactly); returns the number of items kept, mean over the rows."""
        rows = self.active
        B = rows.size
        b = np.arange(B)[:, None]
        cap = self.capacity
        load, count = self.load[rows], self.count[rows]
        open_ = count < cap
        key0 = np.where(open_, load, np.inf)  # [B, P]
        by_load = np.argsort(key0, axis=1, kind="stable")  # open packs by (load, index) first
        left = self.n - self.pos[rows]
        size = np.minimum(open_.sum(axis=1), left)  # items in each row's round
        T = int(size.max())
        t = np.arange(T)[None, :]
        valid = t < size[:, None]
        item = np.minimum(self.pos[rows][:, None] + t, self.n - 1)
        w = self.weight[rows[:, None], item]  # [B, T]
        guess = by_load[:, :T]  # item t -> the t-th lightest open pack
        base = key0[b, guess]  # its load before the round
        after = base + w  # ... after taking item t
        after_key = np.where(count[b, guess] + 1 < cap, after, np.inf)
        # Least key among the packs already given an item in the round, before item t.
        before_min = np.minimum.accumulate(
            np.concatenate([np.full((B, 1), np.inf), after_key[:, :-1]], axis=1), axis=1
        )
        right = before_min > base  # strictly: a tie may go to a lower index
        least = np.minimum(before_min, base)
        if self.sticky is not None:
            cur = self.sticky[rows[:, None], item]
            pos_cur = np.argsort(by_load, axis=1)[b, cur]  # cur's place in the round order
            touched = pos_cur < t
            cur_key = np.where(touched, after_key[b, np.minimum(pos_cur, T - 1)], key0[b, cur])
            right &= ~((cur_key == least) & (cur != guess))
        right |= ~valid
        wrong = ~right
        first = np.where(wrong.any(axis=1), wrong.argmax(axis=1), T)  # first wrong guess
        kept = np.minimum(first + 1, size)
        # Rounds cut short: the run guess (the lightest pack takes the next items) may keep more.
        use_run = np.zeros(B, dtype=bool)
        short = np.flatnonzero((kept < size) | (kept < 2 * MIN_ROUND))
        if short.size:
            run, run_load = self._run(
                rows[short], by_load[short, 0], by_load[short, 1:2], key0[short], left[short]
            )
            better = run > kept[short]
            use_run[short[better]] = True
            kept[short[better]] = run[better]
            self._commit_run(
                rows[short[better]], by_load[short[better], 0], run[better], run_load[better]
            )
        # Rows keeping their round: items before the first wrong guess go to distinct packs.
        keep = (t < first[:, None]) & valid & ~use_run[:, None]
        r_idx, t_idx = np.nonzero(keep)
        self._commit(rows[r_idx], self.pos[rows][r_idx] + t_idx, guess[r_idx, t_idx])
        # The first wrong item: its exact choice, from the round's state before it.
        bad = np.flatnonzero((first < size) & ~use_run)
        if bad.size:
            self._place_exact(rows[bad], first[bad], guess[bad], after_key[bad], base[bad])
        self._advance(rows, kept)
        return float(kept.mean())

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
        self.rank[rows[rr], item] = self.count[rows, pack][rr] + tt
        self.load[rows, pack] = loads[np.arange(rows.size), run]
        self.count[rows, pack] += run

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
            cur_key = np.where(self.count[rows, cur] < self.capacity, self.load[rows, cur], np.inf)
            pack = np.where(cur_key == best, cur, pack)
        self._commit(rows, item, pack)
