"""preflight — see DESIGN.md."""
