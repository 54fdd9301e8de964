"""The verification-cost model: timed rounds, the fits, the model and its one loader, a
calibration run with its report and plots."""
