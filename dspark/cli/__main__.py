"""`python -m dspark.cli`: what the `dspark` script runs."""

from dspark.cli import main

main()
