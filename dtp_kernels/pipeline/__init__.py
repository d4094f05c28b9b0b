"""The pipeline (layer 4 of DESIGN.md section 6): data, training stages, recipes, CLI."""
