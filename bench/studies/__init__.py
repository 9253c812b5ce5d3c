"""One-off studies: questions answered once to choose a design (which prefix matcher, which index
structure, how to pack the pool), kept so that the choice can be revisited with the same method.
Not regression benches; see README.md beside this file."""
