"""Experiments: one-off measurements whose findings are written down in docs/, kept
runnable to repeat them (`python -m loadtest NAME`, listed by `python -m loadtest`).

    ab_queued      queue mode's 202 at the edge, pair by pair    docs/hotpath.md, lever 43
    ab_ticket      a room ticket by callback or by task          docs/hotpath.md, lever 42
    console_bench  the sale with and without live consoles      docs/console.md
    reserve_probe  the reservation procedures alone             docs/reservation-groups.md
    room_memory    bytes per waiting-room ticket                docs/waiting-room.md
    shard_sim      sharding by deal, simulated and checked      docs/scale-out.md

What users run (the scenarios, the verifier, the benchmark runner, the peer baseline,
the documented benchmarks) stays in loadtest/ itself.
"""
