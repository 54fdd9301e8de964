"""The specbound library, a subpackage per stage: models -> data -> extract -> cost -> oracle;
decode (engine and policies) online; predictor and tiny beside them; bench spans stages."""
