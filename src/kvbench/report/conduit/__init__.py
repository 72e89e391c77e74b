"""CONDUIT's writers: Tables 1, 2, 4, 5, the staleness gap and Figure 3 (:mod:`.accuracy`), Table 3 (:mod:`.table3`),
Tables 11-13 (:mod:`.diagnostics`), Tables 14-15 and Figure 4 (:mod:`.evidence`). What each reads is planned by
:mod:`kvbench.plan.conduit`."""
