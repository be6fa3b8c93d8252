"""Running a cluster: launch, serve, lead, the book, the pool controller."""
