"""`state_relay` on its own (no process group): the side words' encoding, and what rank 0's
relay answers and another rank's relay resolves. The protocol over real gloo ranks is in
tests/test_control_plane.py."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamload.errors import UsageError
from streamload.state_relay import StateRelay, decode_states, encode_states

pytestmark = pytest.mark.core


def test_states_round_trip_through_side_words():
    states = [(3, b"abc"), (4, None), (7, b""), (9, b"0123456789")]
    assert decode_states(encode_states(states)) == states
    assert decode_states(np.zeros(0, np.int64)) == []


def relays(keep=2, world=3, every=None):
    encode = lambda snapshot: f"state-{snapshot}".encode()   # noqa: E731 (snapshots: steps)
    return StateRelay(0, world, keep, encode, every), StateRelay(1, world, keep)


def test_a_request_is_answered_with_the_kept_state_and_resolves_the_future():
    async def main():
        zero, one = relays()
        for step in range(4):
            zero.kept(step, step)
        asked = one.get(3)
        assert one.wake.is_set() and one.outgoing().tolist() == [3]
        old = one.get(0)   # no longer kept by rank 0 (keep=2); asked first (the lowest step)
        words = zero.answer([np.zeros(0, np.int64), one.outgoing(), np.zeros(0, np.int64)],
                            False)
        assert words[0].shape[0] == 0 and words[2].shape[0] == 0   # only the one who asked
        one.receive(words[1])
        with pytest.raises(UsageError, match="no longer keeps the state after step 0"):
            old.result(0)
        assert not asked.done() and one.wake.is_set()   # step 3 still asked: the next round
        one.receive(zero.answer([None, one.outgoing(), None], False)[1])
        assert asked.result(0) == b"state-3" and one.get(3) == b"state-3"
        assert not one.wake.is_set()
    asyncio.run(main())


def test_rank_0s_own_state_goes_to_every_rank_and_the_last_reply_carries_all_kept():
    async def main():
        zero, one = relays(keep=3)
        for step in range(5):
            zero.kept(step, step)
        assert zero.own(4) == b"state-4" and zero.wake.is_set()
        words = zero.answer([None] * 3, False)
        assert not zero.wake.is_set() and words[0].shape[0] == 0
        assert decode_states(words[1]) == decode_states(words[2]) == [(4, b"state-4")]
        assert zero.answer([None] * 3, False)[1].shape[0] == 0   # sent once
        zero.finish()
        assert [k for k, _ in decode_states(zero.answer([None] * 3, False)[2])] == [2, 3, 4]
        one.receive(words[1])
        assert one.get(4) == b"state-4"
        one.end(None)
        with pytest.raises(UsageError, match="loop ended"):
            one.get(1).result(0)
    asyncio.run(main())


def test_state_every_sends_unasked():
    async def main():
        zero, _ = relays(every=2)
        for step in range(4):
            zero.kept(step, step)
        assert [k for k, _ in decode_states(zero.answer([None] * 3, False)[1])] == [1, 3]
    asyncio.run(main())
