"""The engine: requests in, tokens out -- scheduler step, model forward, sampling."""
