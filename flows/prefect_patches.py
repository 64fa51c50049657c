"""Changes to Prefect's own behaviour for flockfl's flows, applied when the experiment flow's
module (flows/experiment.py) loads: the end of a flow run no longer waits for Prefect's
heartbeat thread (:func:`heartbeats_without_join`)."""

from __future__ import annotations


def heartbeats_without_join() -> None:
    """Flow runs end without waiting for Prefect's heartbeat thread.

    A flow run sends heartbeats from a daemon thread that sleeps in 1 s steps; at the end of
    every flow run the sync engine joins it, which waits for the current step: 0.5 s per run
    on average, for nothing (the thread exits by itself at its next step). The engine's own
    ``join_on_exit`` switch (what its async engine uses) is set instead. Heartbeats still
    run while the flow does. Left alone if Prefect's function no longer has that switch."""
    import functools
    import inspect

    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if send is None or getattr(send, "flockfl_no_join", False):
        return
    if "join_on_exit" not in inspect.signature(send).parameters:
        return

    @functools.wraps(send)
    def no_join(engine, join_on_exit: bool = True):
        return send(engine, join_on_exit=False)

    no_join.flockfl_no_join = True
    flow_engine._send_heartbeats = no_join
