"""Ctrl-C held off while a training step's update is applied (train/interrupt.py)."""

from __future__ import annotations

import signal
import threading

import pytest

from bigbatch.train.interrupt import sigint_deferred


def test_a_sigint_inside_the_block_arrives_after_it():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            ran.append("rest of the block")
    assert ran == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_inside_the_block_goes_on_as_it_is():
    """A failed update with a Ctrl-C pending: the error propagates (a KeyboardInterrupt would make
    the training loop save the half-applied update as a step boundary)."""
    with pytest.raises(RuntimeError, match="update failed"):
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            raise RuntimeError("update failed")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_user_handler_is_called_once_after_the_block_and_outside_the_main_thread_nothing_changes():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []

    def worker():
        with sigint_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
