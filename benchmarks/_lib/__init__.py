"""What the sections share, none of it a section itself: ``python -m benchmarks`` runs none of these.

* ``report``: Section, Claim, statistics, tables, plots (under ``benchmarks/results/plots``);
  ``benchmarks_md``: writing BENCHMARKS.md from the sections.
* ``engine``: vLLM engines per connector row; ``step_rounds``: the step-time workload of the
  overhead and producer-hold sections.
* ``peers``, ``raw_te``, ``round_trip``, ``p2p_pull``: processes and raw TransferEngine reads behind
  the P2P sections.
* ``store_path``, ``checksums``: the store path's measurement and the checksum ceilings.
* ``cluster``, ``prometheus``, ``serve_client``, ``fake_openai_upstream``: servers, their
  ``/metrics``, vLLM's serving client and a fake upstream for the serving sections.
"""
