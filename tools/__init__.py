"""Developer tools (not shipped): the mutation-testing gate."""
