"""The agent side: environments, tools, the sandbox, rewards, datasets, and the loop that runs one episode."""
