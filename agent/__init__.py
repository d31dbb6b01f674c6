"""hybridmon agent: sampling loop, history, exposition, API and CLI."""
