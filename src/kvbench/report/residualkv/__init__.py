"""ResidualKV's writers: Tables III, VI-VIII and the shared score/paired machinery (:mod:`.tables`), Table I
(:mod:`.table_i`), II (:mod:`.table_ii`), IV (:mod:`.table_iv`), V (:mod:`.table_v`), Figures 3 (:mod:`.fig3`), 13
(:mod:`.fig13`), 5, 6, 8, 10-12 (:mod:`.figures`; ``kvbench report residualkv-fig<N>``: :mod:`.figure_entry`). What
each reads is planned by :mod:`kvbench.plan.residualkv` and its neighbours."""
