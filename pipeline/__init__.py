"""The specbound library, a subpackage per stage: models -> data -> extract -> oracle, with
cost (whose timed rounds run the decode engine) feeding the oracle and the cost-aware policies;
decode (engine and policies) online; predictor and tiny beside them; bench spans stages."""
