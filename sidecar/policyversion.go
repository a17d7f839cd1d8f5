package sidecar

import "sync"

// policyVersion is the policy version the Node owns; the former reads it to measure
// staleness.
type policyVersion struct {
	mu sync.Mutex
	v  int64
}

func (p *policyVersion) get() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.v
}

func (p *policyVersion) set(v int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.v = v
}
