"""The embedded default models: their offline corpus, training and building."""
