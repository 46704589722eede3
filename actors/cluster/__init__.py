"""A Ray cluster's nodes as k3ray sees them: connecting, the settings every node needs, checking
them, and where each replica's actors run."""
