"""Integrations with other libraries. Each submodule imports its library on import; sinkattn itself
never imports them:

    sinkattn.integrations.transformers   Hugging Face transformers: the "sinkattn" attention
                                         implementation and SinkCache (StreamingLLM)
"""
