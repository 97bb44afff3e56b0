"""Who is asking and what they may do: API keys → tenants (401), per-tenant limits (429), prefix-cache salts."""
