"""Batch claims under attack (NOTE [claims]): interrupts in the middle of a batch's claims,
misses nested in a batch's computation that form a cycle across processes, duplicate keys in
a batch, a compute that raises half-way, a sample that cannot be stored. Every count is the
source's own (an O_APPEND file, one byte per computation)."""

from __future__ import annotations

import multiprocessing
import os

import _claims
import _claims_adversary
import numpy as np
import pytest
from test_multiprocess import _run  # start, collect one result each, reap

from shmcache import ShmDatasetCache


def _one(ctx, target, *args, timeout_s: float = 120) -> dict:
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    try:
        status, payload = q.get(timeout=timeout_s)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    assert status == "ok", payload
    return payload


def test_an_interrupt_in_the_middle_of_a_batchs_claims_leaves_none_held():
    """Ctrl-C (a KeyboardInterrupt from a real signal) landing while a batch takes, re-checks,
    computes or releases its claims: afterwards no bucket of the batch is held, by this process's
    account or as another process would find it (a leaked claim makes every other process miss
    those keys wait claim_timeout_s, for as long as this process lives)."""
    got = _one(multiprocessing.get_context("fork"), _claims_adversary.interrupted, 24)
    assert got["landed"] >= 6, got  # the interrupts did land in batches
    assert got["leaked"] == [], f"claims left held after an interrupt (trial, busy, held): {got['leaked']}"
