"""The Bellman oracle: its inputs per acceptance rule (inputs), expert unions, the solver, the
Ray fan-out over sequences (in-sample and cross-fitted), the study (sweep, delta space, lambda,
ablation), context analysis, plots and its speed benchmark."""
