"""The pipeline (layer 4 of docs/design.md section 5): data, training stages, recipes, CLI."""
