"""The embedded platform: `inferplane up` runs workers as local processes, no cluster needed."""
