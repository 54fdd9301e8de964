"""The Bellman oracle: expert unions, the solver, the Ray fan-out over sequences, the study
(sweep, delta space, lambda, ablation), context analysis, plots and its speed benchmark."""
