"""The `shardwise` command line."""
