"""`python -m actdb`: the same as the `actdb` command."""

from .cli import main

main()
