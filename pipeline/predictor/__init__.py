"""The expert predictor (EcoSpec section 4.1) and its training from routing traces."""
